"""``kivi``: KIVI-style quantization of the whole cache, the equal-memory baseline.

After "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache" (``docs/techniques.md#resolution``):
every context token's keys are quantized per channel in groups of :data:`GROUP` tokens and its values per
token (asymmetric, :mod:`kvstate.semantic.quant`), except a full-precision residual of the most recent
``segment.recent`` tokens; nothing is evicted or offloaded. The bits are the most of 8 / 4 / 2 whose
codes, ranges and residual fit ``budget`` x the full KV of the context — so a row at budget ``b`` holds at
most what any other method holds at memory ``b`` — and a budget below the 2-bit minimum is refused naming
it. What is held is what a pass reads (KIVI's kernels read the codes): resident = total = attended = the
codes, ranges and exact tokens (:mod:`kvstate.semantic.accounting`). Tokens fed after compression join the
residual, whose oldest group is quantized once it holds a group beyond ``recent``, so the bytes stay near the
budget while decoding. Ignored: KIVI's fused kernels (here the
dequantized context is kept beside the codes between passes, a CPU-speed shortcut equal to dequantizing at
every pass and not counted as held).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from kvstate.errors import BudgetError
from kvstate.lab.semantic.methods.base import Context, StoreMethod, register
from kvstate.lab.semantic.methods.window import anchor_logits
from kvstate.models.accounting import kv_token_bytes
from kvstate.semantic.bounds import key_bounds
from kvstate.semantic.cache import SemanticCache
from kvstate.semantic.config import SemanticConfig
from kvstate.semantic.quant import QuantKeys, QuantValues, quantize_keys, quantize_values

GROUP = 32  # tokens per key quantization group (KIVI's default)
BITS = (8, 4, 2)  # tried in this order: the most that fit the budget


def kivi_nbytes(n: int, heads: int, d: int, bits: int, element_size: int, group: int = GROUP) -> int:
    """Bytes of ``n`` tokens quantized: key and value codes, each value token's range, each key group's range."""
    row = -(-d * bits // 8)
    groups = -(-n // group)
    return heads * (n * (2 * row + 2 * element_size) + groups * 2 * d * element_size)


@dataclass
class KiviStore:
    q_k: list[tuple[QuantKeys, torch.Tensor, torch.Tensor]]  # per group: codes, per-channel lo / hi (H, D)
    q_v: list[QuantValues]  # per group
    anchor_k: torch.Tensor  # (1, H, A, D) the exact residual + tokens fed since compression
    anchor_v: torch.Tensor
    n_quant: int  # tokens held quantized
    bits: int
    recent: int  # the exact residual's least size
    expanded: list[float] = field(default_factory=list)  # unused: nothing is read back
    reads: list[int] = field(default_factory=list)
    full_at: list[int] = field(default_factory=list)
    _dq: tuple[torch.Tensor, torch.Tensor] | None = None  # the dequantized context (speed only, not counted)

    @property
    def token_bytes(self) -> int:
        return 2 * self.anchor_k.shape[1] * self.anchor_k.shape[3] * self.anchor_k.element_size()

    def quant_nbytes(self) -> int:
        return sum(c.nbytes + lo.nbytes + hi.nbytes for c, lo, hi in self.q_k) + sum(v.nbytes for v in self.q_v)

    def fast_nbytes(self) -> int:
        return self.quant_nbytes() + self.anchor_k.nbytes + self.anchor_v.nbytes

    def working_nbytes(self) -> int:
        return 0

    def slow_nbytes(self) -> int:
        return 0

    def full_nbytes(self) -> int:
        return (self.n_quant + self.anchor_k.shape[2]) * self.token_bytes

    def append(self, keys: torch.Tensor, values: torch.Tensor, *_: Any) -> None:
        """Fed tokens join the exact residual; once it holds a group beyond ``recent`` (and beyond this pass's
        tokens, which attend causally among themselves), its oldest group is quantized, as KIVI does."""
        self.anchor_k = torch.cat([self.anchor_k, keys], 2)
        self.anchor_v = torch.cat([self.anchor_v, values], 2)
        while self.anchor_k.shape[2] - GROUP >= max(self.recent, keys.shape[2]):
            k, v = self.anchor_k[0, :, :GROUP], self.anchor_v[0, :, :GROUP]
            lo, hi = key_bounds(k)
            self.q_k.append((quantize_keys(k, lo, hi, self.bits), lo.contiguous(), hi.contiguous()))
            self.q_v.append(quantize_values(v, self.bits))
            self.anchor_k, self.anchor_v = self.anchor_k[:, :, GROUP:], self.anchor_v[:, :, GROUP:]
            self.n_quant += GROUP
            self._dq = None

    def _context(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self._dq is None:
            ks = [c.dequantize(lo, hi, dtype) for c, lo, hi in self.q_k]
            vs = [v.reconstruct(dtype) for v in self.q_v]
            h, d = self.anchor_k.shape[1], self.anchor_k.shape[3]
            self._dq = (torch.cat(ks, 1) if ks else self.anchor_k.new_zeros(h, 0, d),
                        torch.cat(vs, 1) if vs else self.anchor_v.new_zeros(h, 0, d))
        return self._dq

    def attend(self, query: torch.Tensor, scaling: float, *_: Any) -> torch.Tensor:
        hq, tq, d = query.shape[1:]
        qg, first = anchor_logits(query, self.anchor_k, scaling)  # (H, g*Tq, D), (H, g*Tq, A)
        k, v = self._context(query.dtype)  # (H, n, D): every fed token sees the whole quantized context
        logits = torch.cat([qg @ k.transpose(-1, -2) * scaling, first], -1)
        self.reads.append(self.fast_nbytes())
        self.full_at.append(self.full_nbytes())
        p = torch.softmax(logits.float(), -1).to(query.dtype)
        return (p @ torch.cat([v, self.anchor_v[0]], 1)).reshape(1, hq, tq, d)


class KiviCache(SemanticCache):
    """Every attention layer quantized whole (:class:`KiviStore`) at the most bits the budget holds."""

    def compress(self, surprisal_values: Any = None) -> Any:  # ignores surprisal
        layers = self.semantic_layers
        k0 = layers[0].keys
        t, h, d, e = k0.shape[2], k0.shape[1], k0.shape[3], k0.element_size()
        exact = min(self.config.segment.recent, t)
        n = t - exact
        cap = int(self.config.budget * t * kv_token_bytes(h, d, e))
        held = {b: kivi_nbytes(n, h, d, b, e) + exact * kv_token_bytes(h, d, e) for b in BITS}
        fits = [b for b in BITS if held[b] <= cap]
        if not fits:
            need = held[BITS[-1]]
            raise BudgetError(f"budget {self.config.budget} of full KV ({cap} bytes per layer) cannot hold a "
                              f"{t}-token context quantized at 2 bits with a {exact}-token exact residual: the minimum "
                              f"is {need} bytes, budget >= {need / (t * kv_token_bytes(h, d, e)):.4f}; raise the budget or "
                              "lower recent")
        bits = fits[0]
        for layer in layers:
            k, v = layer.keys[0], layer.values[0]  # (H, T, D)
            q_k, q_v = [], []
            for a in range(0, n, GROUP):
                kg, vg = k[:, a:min(a + GROUP, n)], v[:, a:min(a + GROUP, n)]
                lo, hi = key_bounds(kg)
                q_k.append((quantize_keys(kg, lo, hi, bits), lo.contiguous(), hi.contiguous()))
                q_v.append(quantize_values(vg, bits))
            layer.store = KiviStore(q_k, q_v, layer.keys[:, :, n:].contiguous(), layer.values[:, :, n:].contiguous(), n,
                                      bits, exact)
            layer.keys = layer.values = None
        self.bits = bits
        return None


class Kivi(StoreMethod):
    name: ClassVar[str] = "kivi"
    about: ClassVar[str] = "KIVI-style whole-cache quantization (keys per channel, values per token) at the budget's bytes"
    cache_class: ClassVar[type] = KiviCache

    def config(self, budget: float, ctx: Context) -> SemanticConfig:
        return SemanticConfig(budget=budget, segment=ctx.segment, zoom="none", slow_tier=False)


register(Kivi())
