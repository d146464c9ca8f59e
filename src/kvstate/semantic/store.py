"""One attention layer's two-tier span store and its mixed-resolution attention.

From "SEKV: Resolution-Adaptive Semantic KV Cache with Hierarchical Semantic Memory":

- *fast tier* (the model's device): full K/V of the anchors (sinks, surprisal anchors, recent window and
  every token fed after compression), and per span and KV head a summary key / value (mean of the
  span's keys / values), a routing summary (:meth:`SemanticRouter.route_keys`) and the span's log size;
- *slow tier* (CPU): each span's keys and values as low-rank SVD factors (:mod:`kvstate.semantic.lowrank`).

:meth:`SpanStore.attend` is the mixed-resolution attention: anchors at full resolution; each
unexpanded span as one entry ``(summary key, summary value)`` with ``log |S|`` added to its logit (the
softmax weight of ``|S|`` copies of the summary); each expanded span as its reconstructed tokens. Spans
are expanded per KV head when the relevance of any of that head's queries passes its threshold. With
every span expanded at full rank this equals full attention. Bytes are the ``nbytes`` of the tensors
held; span bookkeeping (positions) lives in the :class:`~kvstate.semantic.segment.Segmentation`.
Ignored: asynchronous prefetch of the next layer's spans (on CPU there is no copy engine to overlap).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from kvstate.semantic.lowrank import LowRank, encode
from kvstate.semantic.router import SemanticRouter
from kvstate.semantic.segment import Segmentation

Zoom = Literal["learned", "all", "none", "soft"]  # "soft": differentiable gates, for training only


@dataclass
class SpanStore:
    anchor_k: torch.Tensor  # (1, H, A, D) full-resolution keys (anchors + tokens fed since compression)
    anchor_v: torch.Tensor  # (1, H, A, D)
    sum_k: torch.Tensor  # (1, H, S, D) mean key per span
    sum_v: torch.Tensor  # (1, H, S, D) mean value per span
    route: torch.Tensor  # (H, S, R) normalised routing summary per span
    log_n: torch.Tensor  # (S,) log of each span's token count
    slow: list[tuple[LowRank, LowRank]] = field(default_factory=list)  # per span: (keys, values), on CPU
    n_tail: int = 0  # trailing anchor entries in the recent window (compressed when they leave it)
    expanded: list[float] = field(default_factory=list)  # per attend call: expanded fraction of span tokens
    # working set: spans expanded at the last call, reconstructed; kept only while they stay expanded
    _working: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    sticky: torch.Tensor | None = None  # (H, S) spans expanded so far in this request (kept expanded if sticky)

    @classmethod
    def build(cls, keys: torch.Tensor, values: torch.Tensor, seg: Segmentation, weights: list[np.ndarray],
              router: SemanticRouter, layer: int, rank: int | None, recent: int, slow_tier: bool = True) -> SpanStore:
        """Compress a full layer (1, H, T, D) by ``seg``; ``weights`` are per-span surprisal weights."""
        idx = torch.as_tensor(seg.anchors, dtype=torch.long)
        store = cls(keys[:, :, idx].contiguous(), values[:, :, idx].contiguous(),
                    keys.new_zeros(1, keys.shape[1], 0, keys.shape[3]), values.new_zeros(1, keys.shape[1], 0, keys.shape[3]),
                    keys.new_zeros(keys.shape[1], 0, router.config.routing_dim), keys.new_zeros(0))
        store.n_tail = int(min(recent, seg.length, len(seg.anchors)))
        spans = [(int(a), int(b)) for a, b in seg.spans]
        store._add_spans(keys[0], values[0], spans, [torch.as_tensor(w) for w in weights], router, layer, rank,
                         slow_tier)
        return store

    def _add_spans(self, keys: torch.Tensor, values: torch.Tensor, spans: list[tuple[int, int]],
                   weights: list[torch.Tensor], router: SemanticRouter, layer: int, rank: int | None,
                   slow_tier: bool) -> None:
        """Append spans [a, b) of keys / values (H, T, D) to both tiers."""
        if not spans:
            return
        sk, sv, rt, ln = [], [], [], []
        with torch.no_grad():
            for (a, b), w in zip(spans, weights, strict=True):
                k, v = keys[:, a:b], values[:, a:b]  # (H, n, D)
                sk.append(k.mean(1))
                sv.append(v.mean(1))
                rt.append(router.route_keys(layer, k, w).to(keys.dtype))
                ln.append(float(np.log(b - a)))
                if slow_tier:
                    self.slow.append((encode(k.cpu(), rank, router.rank_gate, False, k.dtype),
                                      encode(v.cpu(), rank, router.rank_gate, True, v.dtype)))
        self.sum_k = torch.cat([self.sum_k, torch.stack(sk, 1)[None]], 2)
        self.sum_v = torch.cat([self.sum_v, torch.stack(sv, 1)[None]], 2)
        self.route = torch.cat([self.route, torch.stack(rt, 1)], 1)
        self.log_n = torch.cat([self.log_n, self.log_n.new_tensor(ln)])

    @property
    def n_spans(self) -> int:
        return int(self.log_n.shape[0])

    def fast_nbytes(self) -> int:
        return sum(t.nbytes for t in (self.anchor_k, self.anchor_v, self.sum_k, self.sum_v, self.route, self.log_n))

    def slow_nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.slow)

    def append(self, keys: torch.Tensor, values: torch.Tensor, router: SemanticRouter, layer: int,
               rank: int | None, recent: int, max_span: int, slow_tier: bool = True) -> None:
        """Add fed tokens (1, H, t, D) at full resolution; compress the oldest once they leave the window."""
        self.anchor_k = torch.cat([self.anchor_k, keys], 2)
        self.anchor_v = torch.cat([self.anchor_v, values], 2)
        self.n_tail += keys.shape[2]
        while self.n_tail > recent + max_span:
            a = self.anchor_k.shape[2] - self.n_tail
            k, v = self.anchor_k[0, :, a:a + max_span], self.anchor_v[0, :, a:a + max_span]
            self._add_spans(k, v, [(0, max_span)], [torch.full((max_span,), 1.0 / max_span)], router, layer, rank,
                            slow_tier)
            keep = torch.ones(self.anchor_k.shape[2], dtype=torch.bool)
            keep[a:a + max_span] = False
            self.anchor_k, self.anchor_v = self.anchor_k[:, :, keep], self.anchor_v[:, :, keep]
            self.n_tail -= max_span

    def decide(self, query: torch.Tensor, router: SemanticRouter, layer: int, zoom: Zoom) -> torch.Tensor:
        """Which spans each KV head expands: query (Hq, Tq, D) → (H, S) bool."""
        h, s = self.sum_k.shape[1], self.n_spans
        if zoom in ("all", "soft"):
            return torch.ones(h, s, dtype=torch.bool)
        if zoom == "none" or s == 0:
            return torch.zeros(h, s, dtype=torch.bool)
        hit = (router.zoom_logits(layer, query, self.route) > 0).any(1)  # relevance > threshold: (Hq, S)
        return hit.view(h, -1, s).any(1)

    def _reconstruct(self, chosen: tuple[int, ...], dtype: torch.dtype,
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Token-level K/V (H, n_exp, D) of the chosen spans and each token's span index (n_exp,)."""
        work = {i: self._working.get(i) or (self.slow[i][0].reconstruct(dtype, device),
                                            self.slow[i][1].reconstruct(dtype, device)) for i in chosen}
        self._working = work
        rk = torch.cat([work[i][0] for i in chosen], 1)  # (H, n_exp, D)
        rv = torch.cat([work[i][1] for i in chosen], 1)
        sizes = torch.tensor([work[i][0].shape[1] for i in chosen])
        owner = torch.repeat_interleave(torch.tensor(chosen), sizes)  # (n_exp,) span index of each token
        return rk, rv, owner

    def attend(self, query: torch.Tensor, scaling: float, router: SemanticRouter, layer: int,
               zoom: Zoom, sticky: bool = False) -> torch.Tensor:
        """Mixed-resolution attention of the fed tokens' queries (1, Hq, Tq, D) → (1, Hq, Tq, D).

        The last Tq anchor entries are the fed tokens themselves (causal among each other). Query heads
        are grouped per KV head as rows (H, g * Tq) so no key or value is copied per query head.
        """
        q = query[0]  # (Hq, Tq, D)
        hq, tq, d = q.shape
        h = self.anchor_k.shape[1]
        g = hq // h
        qg = q.reshape(h, g * tq, d)  # (H, g*Tq, D), rows ordered (group head, token)
        ka, va = self.anchor_k[0], self.anchor_v[0]  # (H, A, D)
        a = ka.shape[1]
        causal = (torch.arange(a)[None, :] > torch.arange(a - tq, a)[:, None]).repeat(g, 1)  # (g*Tq, A)
        logits = [(qg @ ka.transpose(-1, -2) * scaling).masked_fill(causal, float("-inf"))]  # (H, g*Tq, A)
        vals = [va]
        with torch.no_grad():
            expand = self.decide(q.detach(), router, layer, zoom)  # (H, S)
            if sticky and zoom == "learned":  # a span zoomed into stays expanded for the rest of the request
                if self.sticky is not None:
                    expand[:, : self.sticky.shape[1]] |= self.sticky
                self.sticky = expand.clone()
        if self.n_spans:
            ls = qg @ self.sum_k[0].transpose(-1, -2) * scaling + self.log_n.to(q.dtype)  # (H, g*Tq, S)
            soft = None
            if zoom == "soft":  # summary weighted by 1 - gate, its tokens by gate (training relaxation)
                soft = torch.sigmoid(router.zoom_logits(layer, q, self.route)).to(q.dtype).reshape(h, g * tq, -1)
                logits.append(ls + torch.log1p(-soft + 1e-6))
            else:
                logits.append(ls.masked_fill(expand[:, None, :], float("-inf")))
            vals.append(self.sum_v[0])
            chosen = tuple(torch.nonzero(expand.any(0)).flatten().tolist())
            if chosen:
                rk, rv, owner = self._reconstruct(chosen, q.dtype, q.device)
                le = qg @ rk.transpose(-1, -2) * scaling  # (H, g*Tq, n_exp)
                if soft is not None:
                    logits.append(le + torch.log(soft[:, :, owner] + 1e-6))
                else:
                    logits.append(le.masked_fill(~expand[:, owner][:, None, :], float("-inf")))
                vals.append(rv)
                n_tok = torch.exp(self.log_n).round()
                self.expanded.append(float((expand.float() * n_tok).sum(1).mean() / n_tok.sum()))
            else:
                self.expanded.append(0.0)
        p = torch.softmax(torch.cat(logits, -1).float(), -1).to(q.dtype)  # (H, g*Tq, A + S + n_exp)
        out = p @ torch.cat(vals, 1)  # (H, g*Tq, D)
        return out.reshape(1, hq, tq, d)
