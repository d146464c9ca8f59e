"""``sekv_pages16`` / ``sekv_pages32`` / ``sekv_pages64`` (``sekv_pages32_v2``: 2-bit values): SEKV's tiers over
fixed pages, routed by mean key, read as 4-bit codes — the design the real-model routing probe points to (issue 48).

SEKV ("SEKV: Resolution-Adaptive Semantic KV Cache with Hierarchical Semantic Memory",
``docs/techniques.md#resolution``) keeps anchors at full precision, the rest in a compressed slow tier, and zooms
into what the query needs within a read budget. On the real model its bound routing collapses at 8:1 reads
(``models/smollm2/sekv_2048.json``), and the probe (:mod:`kvstate.lab.semantic.real_routing`) separates why: a
page's min / max keys take half the read budget, and Quest's bound ranks pages far below their true attention
mass, where ``q . mean key`` ranks them close to it. This method changes exactly those, as an ablation of SEKV:

- **anchors**: the sinks and the recent window (and every token fed since compression) at full precision;
- **slow tier**: the middle cut into pages of ``page`` tokens, keys quantized per channel within each page's
  min / max (the quantizer's ranges, held with the codes), values per token (:mod:`kvstate.semantic.quant`,
  KIVI-style, 4-bit);
- **routing**: one mean key per page and KV head (the raw keys' mean, held beside the anchors), ranked by
  ``q . mean key`` under the last fed token's queries (``route_query="all"``: every fed token), the largest over
  the KV head's query heads; the heads' rankings taken in turn, as the Quest-like baseline;
- **reads**: a page read is its codes and its ranges — what a kernel attending on codes fetches (KIVI's
  accounting in this bench) — dequantized and attended at full resolution by every head. The read budget is
  counted in **bf16** bytes (``FLOAT_BYTES``): per pass, anchors + mean keys + the pages read stay within
  ``budget`` x the bf16 K/V of the tokens seen, and :func:`kvstate.lab.semantic.bf16.counts` counts the same
  through :meth:`CodePageStore.pass_reads`.

No semantic spans (pages are fixed), no bound guarantee (the mean key is a summary), no sticky working set.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from kvstate.lab.semantic.methods.base import Role, register
from kvstate.lab.semantic.methods.quest import PageStore, Quest, QuestCache
from kvstate.lab.semantic.methods.window import anchor_logits
from kvstate.semantic.quant import QuantValues, _codes, _dequantize, pack, quantize_values, unpack

FLOAT_BYTES = 2  # the read budget's unit: bf16


@dataclass
class CodePageStore:
    anchor_k: torch.Tensor  # (1, H, A, D) sinks + recent window + tokens fed since compression
    anchor_v: torch.Tensor
    page_mean: torch.Tensor  # (H, P, D) mean raw key per page: the routing summary
    page_min: torch.Tensor  # (H, P, D) the keys' quantizer ranges per page and channel (slow tier)
    page_max: torch.Tensor
    k_codes: torch.Tensor  # (H, M, ceil(D * bits / 8)) uint8
    v_quant: QuantValues  # the middle's values, per token
    page: int
    budget: float
    bits: int = 4  # the keys' codes
    route_query: str = "last"
    v_bits: int = 4  # the values' codes
    expanded: list[float] = field(default_factory=list)
    reads: list[int] = field(default_factory=list)  # per pass, in the cache's dtype: floating bytes + code bytes
    full_at: list[int] = field(default_factory=list)
    parts: list[tuple[int, int]] = field(default_factory=list)  # per pass: (floating elements read, code bytes read)

    @property
    def n_mid(self) -> int:
        return int(self.k_codes.shape[1])

    @property
    def heads_dim(self) -> tuple[int, int]:
        return int(self.anchor_k.shape[1]), int(self.anchor_k.shape[3])

    @property
    def token_bytes(self) -> int:
        h, d = self.heads_dim
        return 2 * h * d * self.anchor_k.element_size()

    def fast_nbytes(self) -> int:
        return self.anchor_k.nbytes + self.anchor_v.nbytes + self.page_mean.nbytes

    def working_nbytes(self) -> int:
        return 0

    def slow_nbytes(self) -> int:
        return self.k_codes.nbytes + self.v_quant.nbytes + self.page_min.nbytes + self.page_max.nbytes

    def full_nbytes(self) -> int:
        return (self.anchor_k.shape[2] + self.n_mid) * self.token_bytes

    def append(self, keys: torch.Tensor, values: torch.Tensor, *_: Any) -> None:
        self.anchor_k = torch.cat([self.anchor_k, keys], 2)
        self.anchor_v = torch.cat([self.anchor_v, values], 2)

    def _fixed_elements(self) -> int:
        """Floating elements every pass reads: the anchors and the mean keys."""
        return self.anchor_k.numel() + self.anchor_v.numel() + self.page_mean.numel()

    def _page_cost(self, p: int) -> tuple[int, int]:
        """(floating elements, code bytes) of reading page ``p``: its key ranges and value ranges, its codes."""
        h, d = self.heads_dim
        n = min((p + 1) * self.page, self.n_mid) - p * self.page
        codes = n * h * (self.k_codes.shape[2] + self.v_quant.codes.shape[2])
        return 2 * h * d + 2 * h * n, codes

    def allowance(self) -> int:
        """bf16 bytes left for pages in this pass: ``budget`` x the bf16 K/V of the tokens seen, less anchors and
        mean keys."""
        h, d = self.heads_dim
        seen = self.anchor_k.shape[2] + self.n_mid
        return int(self.budget * seen * 2 * h * d * FLOAT_BYTES) - self._fixed_elements() * FLOAT_BYTES

    def pick(self, order: torch.Tensor) -> list[int]:
        """Pages from the heads' rankings ``order`` (H, P) in turn while their bf16 cost fits the allowance."""
        left, chosen = self.allowance(), []
        for p in order.T.flatten().tolist():
            if p in chosen:
                continue
            floats, codes = self._page_cost(p)
            cost = floats * FLOAT_BYTES + codes
            if cost > left:
                break
            chosen.append(p)
            left -= cost
        return chosen

    def pass_reads(self, element_size: int) -> list[int]:
        """Bytes each pass read with floating tensors of ``element_size`` (codes as they are)."""
        return [f * element_size + c for f, c in self.parts]

    def attend(self, query: torch.Tensor, scaling: float, *_: Any) -> torch.Tensor:
        q = query[0]  # (Hq, Tq, D)
        hq, tq, d = q.shape
        h = self.anchor_k.shape[1]
        g = hq // h
        qg, first = anchor_logits(query, self.anchor_k, scaling)
        qr = qg.view(h, g, tq, d)[:, :, -1] if self.route_query == "last" else qg  # (H, rows, D)
        score = (qr.float() @ self.page_mean.float().transpose(-1, -2)).amax(1)  # (H, P)
        chosen = sorted(self.pick(score.argsort(dim=1, descending=True)))
        logits, vals = [first], [self.anchor_v[0]]
        floats, codes = self._fixed_elements(), 0
        if chosen:
            tok = torch.cat([torch.arange(p * self.page, min((p + 1) * self.page, self.n_mid)) for p in chosen])
            pid = tok // self.page
            rk = _dequantize(unpack(self.k_codes[:, tok], self.bits, d), self.page_min[:, pid], self.page_max[:, pid],
                             self.bits).to(q.dtype)
            vq = self.v_quant
            rv = QuantValues(vq.codes[:, tok], vq.lo[:, tok], vq.hi[:, tok], self.v_bits, d).reconstruct(q.dtype)
            logits.append(qg @ rk.transpose(-1, -2) * scaling)
            vals.append(rv)
            for p in chosen:
                f, c = self._page_cost(p)
                floats, codes = floats + f, codes + c
            self.expanded.append(len(tok) / self.n_mid)
        else:
            self.expanded.append(0.0)
        self.parts.append((floats, codes))
        self.reads.append(floats * self.anchor_k.element_size() + codes)
        self.full_at.append(self.full_nbytes())
        p = torch.softmax(torch.cat(logits, -1).float(), -1).to(q.dtype)
        return (p @ torch.cat(vals, 1)).reshape(1, hq, tq, d)


def code_pages(store: PageStore, bits: int, v_bits: int | None = None) -> CodePageStore:
    """``store``'s raw middle as ``bits``-bit key codes and ``v_bits``-bit value codes (default ``bits``), with
    one mean key per page (over the page's own tokens)."""
    v_bits = bits if v_bits is None else v_bits
    h, m, d = store.slow_k.shape
    n_pages, page = store.page_min.shape[1], store.page
    pid = torch.arange(m) // page
    sums = torch.zeros(h, n_pages, d, dtype=store.slow_k.dtype).index_add_(1, pid, store.slow_k)
    counts = torch.bincount(pid, minlength=n_pages).to(store.slow_k.dtype)
    k_codes = pack(_codes(store.slow_k, store.page_min[:, pid], store.page_max[:, pid], bits), bits).contiguous()
    return CodePageStore(store.anchor_k, store.anchor_v, (sums / counts[None, :, None]).contiguous(), store.page_min,
                         store.page_max, k_codes, quantize_values(store.slow_v, v_bits), page, store.budget, bits,
                         store.route_query, v_bits)


class CodePageCache(QuestCache):
    """:class:`QuestCache` whose layers hold :class:`CodePageStore` (4-bit codes, mean-key routing)."""

    bits = 4
    v_bits = 4

    def compress(self, surprisal_values: Any = None) -> Any:
        super().compress(surprisal_values)
        for layer in self.semantic_layers:
            assert isinstance(layer.store, PageStore)
            layer.store = code_pages(layer.store, self.bits, self.v_bits)
        return None


class CodePage16Cache(CodePageCache):
    page = 16


class CodePage32Cache(CodePageCache):
    page = 32


class CodePage64Cache(CodePageCache):
    page = 64


class CodePage32V2Cache(CodePageCache):
    page = 32
    v_bits = 2


class SekvPages(Quest):
    name: ClassVar[str] = "sekv_pages32"
    role: ClassVar[Role] = "ablation"
    about: ClassVar[str] = "SEKV over 32-token pages: 4-bit codes read as codes, routed by mean key"
    cache_class: ClassVar[type] = CodePage32Cache


class SekvPages16(SekvPages):
    name: ClassVar[str] = "sekv_pages16"
    about: ClassVar[str] = "SEKV over 16-token pages: 4-bit codes read as codes, routed by mean key"
    cache_class: ClassVar[type] = CodePage16Cache


class SekvPages64(SekvPages):
    name: ClassVar[str] = "sekv_pages64"
    about: ClassVar[str] = "SEKV over 64-token pages: 4-bit codes read as codes, routed by mean key"
    cache_class: ClassVar[type] = CodePage64Cache


class SekvPages32V2(SekvPages):
    name: ClassVar[str] = "sekv_pages32_v2"
    about: ClassVar[str] = "SEKV over 32-token pages: 4-bit key and 2-bit value codes read as codes, routed by mean key"
    cache_class: ClassVar[type] = CodePage32V2Cache


register(SekvPages16())
register(SekvPages())
register(SekvPages64())
register(SekvPages32V2())
