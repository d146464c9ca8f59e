"""A Quest-like query-aware page selection baseline (in-project; kvpress has no such press).

After "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference": the context between the
sink tokens and the recent window is cut into pages of ``page`` tokens; the fast tier keeps the sinks,
the recent window and, per page and KV head, the element-wise minimum and maximum key. At each forward
call a page's attention upper bound ``sum_d max(q_d min_d, q_d max_d)`` (maximised over the KV head's
query heads and, as SEKV's ``route_query``, the last fed token — or every fed token with
``route_query="all"``) ranks the pages per KV head, and pages are read from the slow tier (the
raw page K/V on CPU) — taken from the heads' rankings in turn, so the union over heads is what is
materialised — and attended at full resolution by every head. The number of pages is capped at every
forward call so the fast tier plus the pages read stay within ``budget`` x the full KV of the tokens seen
(the same read budget as SEKV's, :mod:`kvstate.semantic.accounting`). Ignored: Quest's GPU kernels and
per-layer budgets (the first layers are not kept dense here).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from kvstate.errors import BudgetError
from kvstate.lab.semantic.methods.base import Context, StoreMethod, register
from kvstate.lab.semantic.methods.window import anchor_logits
from kvstate.semantic.cache import SemanticCache
from kvstate.semantic.config import SemanticConfig


@dataclass
class PageStore:
    anchor_k: torch.Tensor  # (1, H, A, D) sinks + recent window + tokens fed since compression
    anchor_v: torch.Tensor
    page_min: torch.Tensor  # (H, P, D) element-wise min key per page
    page_max: torch.Tensor  # (H, P, D)
    slow_k: torch.Tensor  # (H, M, D) raw keys of the paged middle, on CPU
    slow_v: torch.Tensor
    page: int  # tokens per page
    budget: float  # (fast tier + pages read) / full KV of the tokens seen, at every call
    top_k: int | None = None  # a fixed page count instead of the budget (the every-page oracle in the tests)
    route_query: str = "last"  # which fed tokens' queries rank pages: "last" (as SEKV's default) or "all"
    expanded: list[float] = field(default_factory=list)
    reads: list[int] = field(default_factory=list)  # per call: K/V bytes materialised and read
    full_at: list[int] = field(default_factory=list)  # per call: full K/V bytes of the tokens seen then

    @property
    def token_bytes(self) -> int:
        return 2 * self.anchor_k.shape[1] * self.anchor_k.shape[3] * self.anchor_k.element_size()

    def fast_nbytes(self) -> int:
        return sum(t.nbytes for t in (self.anchor_k, self.anchor_v, self.page_min, self.page_max))

    def working_nbytes(self) -> int:
        return 0  # pages are read per call and dropped

    def slow_nbytes(self) -> int:
        return self.slow_k.nbytes + self.slow_v.nbytes

    def full_nbytes(self) -> int:
        return (self.anchor_k.shape[2] + self.n_mid) * self.token_bytes

    @property
    def n_mid(self) -> int:
        """Tokens of the paged middle (the slow tier)."""
        return int(self.slow_k.shape[1])

    def read_pages(self, tok: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values (H, n, D) of the middle's tokens ``tok``, as attention reads them."""
        return self.slow_k[:, tok].to(dtype), self.slow_v[:, tok].to(dtype)

    def append(self, keys: torch.Tensor, values: torch.Tensor, *_: Any) -> None:
        self.anchor_k = torch.cat([self.anchor_k, keys], 2)
        self.anchor_v = torch.cat([self.anchor_v, values], 2)

    def n_pages_now(self) -> int:
        if self.top_k is not None:
            return self.top_k
        left = int(self.budget * self.full_nbytes()) - self.fast_nbytes()
        return max(0, left // (self.page * self.token_bytes))

    def attend(self, query: torch.Tensor, scaling: float, *_: Any) -> torch.Tensor:
        q = query[0]  # (Hq, Tq, D)
        hq, tq, d = q.shape
        h = self.anchor_k.shape[1]
        g = hq // h
        qg, first = anchor_logits(query, self.anchor_k, scaling)  # (H, g*Tq, D), (H, g*Tq, A)
        logits = [first]
        vals = [self.anchor_v[0]]
        read = self.anchor_k.nbytes + self.anchor_v.nbytes
        n_pages = self.page_min.shape[1]
        k = min(self.n_pages_now(), n_pages)
        if k > 0:
            qr = qg.view(h, g, tq, d)[:, :, -1] if self.route_query == "last" else qg  # (H, rows, D)
            bound = torch.maximum(qr[:, :, None, :] * self.page_min[:, None], qr[:, :, None, :] * self.page_max[:, None])
            order = bound.sum(-1).amax(1).argsort(dim=1, descending=True)  # (H, P) pages by upper bound, per head
            chosen: list[int] = []
            for p in order.T.flatten().tolist():  # the heads' rankings in turn: rank 0 of every head, then rank 1 ...
                if p not in chosen:
                    chosen.append(p)
                    if len(chosen) == k:
                        break
            chosen.sort()
            m = self.n_mid
            tok = torch.cat([torch.arange(p * self.page, min((p + 1) * self.page, m)) for p in chosen])
            rk, rv = self.read_pages(tok, q.dtype)  # (H, n_sel, D)
            read += rk.nbytes + rv.nbytes
            logits.append(qg @ rk.transpose(-1, -2) * scaling)  # (H, g*Tq, n_sel)
            vals.append(rv)
            self.expanded.append(len(tok) / m)
        elif n_pages:
            self.expanded.append(0.0)
        self.reads.append(read)
        self.full_at.append(self.full_nbytes())
        p = torch.softmax(torch.cat(logits, -1).float(), -1).to(q.dtype)
        return (p @ torch.cat(vals, 1)).reshape(1, hq, tq, d)


class QuestCache(SemanticCache):
    """A :class:`SemanticCache` whose layers hold :class:`PageStore` (same protocol, same read budget)."""

    page = 16

    def compress(self, surprisal_values: Any = None) -> Any:  # Quest ignores surprisal
        layers = self.semantic_layers
        k0 = layers[0].keys
        t = k0.shape[2]
        seg = self.config.segment
        lo, hi = min(seg.sinks, t), max(min(seg.sinks, t), t - seg.recent)
        h, d, e = k0.shape[1], k0.shape[3], k0.element_size()
        token_bytes = 2 * h * d * e
        n_pages = -(-(hi - lo) // self.page)
        fast = (lo + t - hi) * token_bytes + 2 * n_pages * h * d * e
        budget = int(self.config.budget * t * token_bytes)
        if fast > budget:
            raise BudgetError(f"budget {self.config.budget} of full KV ({budget} bytes per layer) cannot hold the sinks, "
                              f"recent window and page metadata of a {t}-token context: the minimum is {fast} bytes, "
                              f"budget >= {fast / (t * token_bytes):.4f}")
        keep = torch.as_tensor(np.r_[0:lo, hi:t], dtype=torch.long)
        for layer in layers:
            k, v = layer.keys, layer.values
            mid = k[0, :, lo:hi]  # (H, M, D)
            pad = n_pages * self.page - mid.shape[1]
            padded = torch.cat([mid, mid[:, -1:].expand(-1, pad, -1)], 1) if pad else mid
            pages = padded.reshape(h, n_pages, self.page, d)
            layer.store = PageStore(k[:, :, keep].contiguous(), v[:, :, keep].contiguous(), pages.amin(2), pages.amax(2),
                                    mid.cpu().contiguous(), v[0, :, lo:hi].cpu().contiguous(), self.page,
                                    self.config.budget, route_query=self.config.route_query)
            layer.keys = layer.values = None
        return None


class Quest(StoreMethod):
    name: ClassVar[str] = "quest"
    about: ClassVar[str] = "Quest-like pages: page min / max keys on the device, pages read by bound within the budget"
    cache_class: ClassVar[type] = QuestCache

    def config(self, budget: float, ctx: Context) -> SemanticConfig:
        return SemanticConfig(budget=budget, segment=ctx.segment, zoom="none", slow_tier=False)

    def expanded(self, cache: Any) -> float | None:
        return float(cache.expanded_fraction())


register(Quest())
