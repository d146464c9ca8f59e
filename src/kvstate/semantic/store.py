"""One attention layer's two-tier span store and its mixed-resolution attention, under a read budget.

From "SEKV: Resolution-Adaptive Semantic KV Cache with Hierarchical Semantic Memory":

- *fast tier* (the model's device): full K/V of the anchors (sinks, surprisal anchors, recent window and
  every token fed after compression), and per span and KV head a summary key / value (mean of the
  span's keys / values), the span's log size, and what routing needs: the per-channel min / max of the
  keys the slow tier gives back (``routing="bounds"``, :mod:`kvstate.semantic.bounds`; for a quantized
  span this is its quantizer range, stored once) or a routing summary (:meth:`SemanticRouter.route_keys`);
- *slow tier* (CPU): each span's keys and values as low-rank SVD factors (:mod:`kvstate.semantic.lowrank`),
  ranks allocated under the slow-tier cap (:mod:`kvstate.semantic.ranks`), KIVI-style codes
  (:mod:`kvstate.semantic.quant`, outlier spans unquantized), or raw (the ablation). The cap is
  ``slow_cap`` bytes (set by the cache from ``memory``) or ``slow_budget`` x the spans' raw K/V.

:meth:`SpanStore.attend` is the mixed-resolution attention: anchors at full resolution; each
unexpanded span as one entry ``(summary key, summary value)`` with ``log |S|`` added to its logit (the
softmax weight of ``|S|`` copies of the summary); each expanded span as its reconstructed tokens. Under
``zoom="routed"`` every span is a candidate ranked by Quest's bound (``routing="bounds"``: at least the
largest logit any of its keys can give, so a span holding a key aligned with the query is never ranked
below a span that does not reach it), or a KV head wants a span when the learned relevance of any of its
queries passes its threshold (``"learned"``, the paper's routing); under ``"similarity"`` every span is a
candidate ranked by ``q . mean key``. The budget governs the reads:
candidates are taken by relevance, most relevant first, while the fast tier plus the reconstructed
spans (all heads of a chosen span: the union is what is materialised) stay within ``budget`` x the full
KV of the tokens seen — as Quest's top-k is capped. A pass of several tokens (the question) is ranked by
its last token's query (``route_query="last"``, the token whose output predicts the next one) or by the
maximum over its tokens (``"all"``). With ``sticky`` the expanded spans form a working set
that stays on the device and stays expanded while it fits; the least relevant span is evicted first;
without it, spans are expanded for one pass and dropped (nothing held beyond the fast and slow tiers).
Tokens fed after compression fold into spans once ``max_span`` of them have left the recent window, or
earlier (at least ``min_span``) when the fast tier alone would pass the budget. With every span expanded
at full rank (``zoom="all"``, the uncapped oracle) this equals full attention. Bytes are the ``nbytes``
of the tensors held and read (:mod:`kvstate.semantic.accounting`); span bookkeeping (positions) lives in
the :class:`~kvstate.semantic.segment.Segmentation`. Ignored: asynchronous prefetch of the next layer's
spans (on CPU there is no copy engine to overlap).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from kvstate.errors import BudgetError
from kvstate.semantic.bounds import key_bounds, upper_bound
from kvstate.semantic.config import SemanticConfig, Zoom
from kvstate.semantic.lowrank import LowRank, Raw, byte_cap, encode, gate_rank, svd, truncate
from kvstate.semantic.quant import (
    EXACT,
    QuantKeys,
    QuantValues,
    in_span_similarity,
    outlier_spans,
    quantize_keys,
    quantize_values,
)
from kvstate.semantic.ranks import allocate_ranks, rank_cost
from kvstate.semantic.router import SemanticRouter
from kvstate.semantic.segment import Segmentation

__all__ = ["SlowCapError", "SpanStore", "Zoom"]

Factors = LowRank | Raw | QuantKeys | QuantValues


class SlowCapError(BudgetError):
    """The slow tier's minimum does not fit its cap; ``need`` is that minimum in bytes (the cache names the
    memory it takes)."""

    def __init__(self, need: int, what: str) -> None:
        super().__init__(f"the slow tier needs at least {need} bytes ({what})")
        self.need = need
        self.what = what


@dataclass
class SpanStore:
    anchor_k: torch.Tensor  # (1, H, A, D) full-resolution keys (anchors + tokens fed since compression)
    anchor_v: torch.Tensor  # (1, H, A, D)
    sum_k: torch.Tensor  # (1, H, S, D) mean key per span
    sum_v: torch.Tensor  # (1, H, S, D) mean value per span
    route: torch.Tensor  # (H, S, R) normalised routing summary per span
    log_n: torch.Tensor  # (S,) log of each span's token count
    k_lo: torch.Tensor | None = None  # (H, S, D) per-channel min of the keys the slow tier returns (None: no bounds)
    k_hi: torch.Tensor | None = None  # (H, S, D) per-channel max; for a quantized span, its quantizer range
    slow_cap: int | None = None  # bytes the slow tier may hold (from ``memory``); None: slow_budget x raw span K/V
    sizes: list[int] = field(default_factory=list)  # per span: its token count
    slow: list[tuple[Factors, Factors]] = field(default_factory=list)  # per span: (keys, values), on CPU
    raw_span_bytes: int = 0  # raw K/V bytes of the spans in the slow tier (the slow budget's reference)
    n_tail: int = 0  # trailing anchor entries in the recent window (compressed when they leave it)
    expanded: list[float] = field(default_factory=list)  # per attend call: expanded fraction of span tokens
    reads: list[int] = field(default_factory=list)  # per attend call: K/V bytes materialised and read
    full_at: list[int] = field(default_factory=list)  # per attend call: full K/V bytes of the tokens seen then
    # working set: reconstructed K/V of the spans expanded at the last call; kept while they stay expanded
    _working: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # the same working set joined (span ids, keys (H, n_exp, D), values, span of each token): _working holds views
    # into these, so it is held once; reused while the same spans are expanded
    _joined: tuple[tuple[int, ...], torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    sticky: torch.Tensor | None = None  # (H, S) heads expanding each span of the working set (sticky only)

    @classmethod
    def build(cls, keys: torch.Tensor, values: torch.Tensor, seg: Segmentation, weights: list[np.ndarray],
              router: SemanticRouter, layer: int, config: SemanticConfig, slow_cap: int | None = None) -> SpanStore:
        """Compress a full layer (1, H, T, D) by ``seg``; ``weights`` are per-span surprisal weights;
        ``slow_cap``: bytes the slow tier may hold (:class:`SlowCapError` if its minimum does not fit)."""
        idx = torch.as_tensor(seg.anchors, dtype=torch.long)
        h, d = keys.shape[1], keys.shape[3]
        r = router.config.routing_dim if config.route_summaries else 0
        store = cls(keys[:, :, idx].contiguous(), values[:, :, idx].contiguous(),
                    keys.new_zeros(1, h, 0, d), values.new_zeros(1, h, 0, d),
                    keys.new_zeros(h, 0, r), keys.new_zeros(0),
                    keys.new_zeros(h, 0, d) if config.bounds else None,
                    keys.new_zeros(h, 0, d) if config.bounds else None, slow_cap)
        store.n_tail = int(min(config.segment.recent, seg.length, len(seg.anchors)))
        spans = [(int(a), int(b)) for a, b in seg.spans]
        store._add_spans(keys[0], values[0], spans, [torch.as_tensor(w) for w in weights], router, layer, config,
                         first=True)
        return store

    @property
    def n_spans(self) -> int:
        return int(self.log_n.shape[0])

    @property
    def token_bytes(self) -> int:
        """Full K/V bytes of one token over this layer's KV heads."""
        k = self.anchor_k
        return 2 * k.shape[1] * k.shape[3] * k.element_size()

    def _slow_tier(self, keys: torch.Tensor, values: torch.Tensor, spans: list[tuple[int, int]],
                   config: SemanticConfig, router: SemanticRouter, first: bool) -> list[tuple[Factors, Factors]]:
        """Slow-tier entries of spans [a, b) of keys / values (H, T, D), ranks allocated under the slow budget."""
        parts = [(keys[:, a:b].cpu(), values[:, a:b].cpu()) for a, b in spans]
        raw = sum(x.nbytes for k, v in parts for x in (k, v))
        if self.slow_cap is not None:
            budget = self.slow_cap - self.slow_nbytes()
        else:
            budget = int(config.slow_budget * (self.raw_span_bytes + raw)) - self.slow_nbytes()
        self.raw_span_bytes += raw
        if config.slow == "raw":
            if first and self.slow_cap is not None and raw > budget:
                raise SlowCapError(self.slow_nbytes() + raw, "raw span K/V")
            return [(Raw(k.clone()), Raw(v.clone())) for k, v in parts]
        if config.slow == "quant":
            return self._quant_tier(parts, config, first, budget)
        if config.rank is not None:  # a fixed rank: the oracle / ablation, outside the slow budget
            return [(encode(k, config.rank, None, False, k.dtype), encode(v, config.rank, None, True, v.dtype))
                    for k, v in parts]
        h, d, e = keys.shape[0], keys.shape[2], keys.element_size()
        svds, gains, costs, caps = [], [], [], []
        for k, v in parts:
            for x, is_v in ((k, False), (v, True)):
                u, sv, vh = svd(x)
                n = x.shape[1]
                svds.append((u, sv, vh))
                energy = (sv**2).sum(0)  # energy per rank over heads: non-increasing
                # as a fraction of this matrix's energy: keys put most of theirs in one direction, so absolute
                # energy would spend the budget on values and leave the keys at rank 1-2, too coarse to find
                # a needle; relative energy equalises the relative error of keys and values
                gains.append((energy / energy.sum().clamp_min(1e-30)).numpy())
                costs.append(rank_cost(n, d, h, e))
                caps.append(min(gate_rank(sv, router.rank_gate, is_v), config.max_rank, byte_cap(n, d)))
        try:
            ranks = allocate_ranks(gains, costs, caps, budget)
        except ValueError as exc:
            if not first:  # a span folded during decoding keeps rank 1 (its share is spent below that)
                ranks = np.ones(len(costs), dtype=np.int64)
            elif self.slow_cap is not None:
                raise SlowCapError(self.slow_nbytes() + sum(costs), "rank 1 per span") from None
            else:
                need = sum(costs)
                raise BudgetError(f"SemanticConfig.slow_budget={config.slow_budget}: {exc} — "
                                  f"slow_budget >= {need / raw:.4f} of the raw span K/V ({raw} bytes) for this "
                                  "context; raise slow_budget, raise max_span (longer spans) or use slow='raw'") \
                    from None
        out = [truncate(*svds[i], int(ranks[i]), keys.dtype) for i in range(len(svds))]
        return list(zip(out[0::2], out[1::2], strict=True))

    def _quant_tier(self, parts: list[tuple[torch.Tensor, torch.Tensor]], config: SemanticConfig, first: bool,
                    budget: int) -> list[tuple[Factors, Factors]]:
        """KIVI-style entries of spans (keys, values) (H, n, D); at compression the ``outliers`` share of spans
        with the least alike keys (ShadowKV) stay unquantized. A span folded while decoding is quantized alone."""
        out: list[tuple[Factors, Factors]] = []
        for k, v in parts:
            if config.bits == EXACT:
                out.append((Raw(k.clone()), Raw(v.clone())))
            else:
                lo, hi = key_bounds(k)  # (H, D): the quantizer's range, kept by the store as the span's bounds
                out.append((quantize_keys(k, lo, hi, config.bits), quantize_values(v, config.bits)))
        need = sum(x.nbytes for pair in out for x in pair)
        if first and self.slow_cap is not None and need > budget:
            raise SlowCapError(self.slow_nbytes() + need, f"{config.bits}-bit codes")
        if first and config.bits != EXACT:
            # outlier spans (least alike first) go back to exact while the slow tier stays within its cap: under
            # ``memory`` the share is a ceiling, so a tight cap keeps fewer exact rather than refusing the run
            sim = [in_span_similarity(k) for k, _ in parts]
            for i in sorted(outlier_spans(sim, config.outliers), key=lambda j: (sim[j], j)):
                k, v = parts[i]
                extra = k.nbytes + v.nbytes - sum(x.nbytes for x in out[i])
                if self.slow_cap is None or need + extra <= budget:
                    out[i] = (Raw(k.clone()), Raw(v.clone()))
                    need += extra
        return out

    def _keys_of(self, i: int, dtype: torch.dtype, device: torch.device | str | None = None) -> torch.Tensor:
        """The keys (H, n, D) span ``i``'s slow-tier entry gives back (a quantized entry within its bounds)."""
        fk = self.slow[i][0]
        if isinstance(fk, QuantKeys):
            assert self.k_lo is not None and self.k_hi is not None
            return fk.dequantize(self.k_lo[:, i], self.k_hi[:, i], dtype, device)
        return fk.reconstruct(dtype, device)

    def _add_spans(self, keys: torch.Tensor, values: torch.Tensor, spans: list[tuple[int, int]],
                   weights: list[torch.Tensor], router: SemanticRouter, layer: int, config: SemanticConfig,
                   first: bool = False) -> None:
        """Append spans [a, b) of keys / values (H, T, D) to both tiers."""
        if not spans:
            return
        sk, sv, rt, ln, lo, hi = [], [], [], [], [], []
        h = keys.shape[0]
        with torch.no_grad():
            entries = self._slow_tier(keys, values, spans, config, router, first) if config.slow_tier else []
            for j, ((a, b), w) in enumerate(zip(spans, weights, strict=True)):
                k, v = keys[:, a:b], values[:, a:b]  # (H, n, D)
                sk.append(k.mean(1))
                sv.append(v.mean(1))
                rt.append(router.route_keys(layer, k, w).to(keys.dtype) if config.route_summaries
                          else keys.new_zeros(h, 0))
                ln.append(float(np.log(b - a)))
                if config.bounds:  # over the keys attention will read: quantized ones within their range
                    e = entries[j][0] if entries else None
                    read = k if e is None or isinstance(e, QuantKeys) else e.reconstruct(keys.dtype)
                    lk, hk = key_bounds(read.to(keys.device))  # (H, D)
                    lo.append(lk)
                    hi.append(hk)
            self.slow += entries
        if lo:
            assert self.k_lo is not None and self.k_hi is not None
            self.k_lo = torch.cat([self.k_lo, torch.stack(lo, 1)], 1)
            self.k_hi = torch.cat([self.k_hi, torch.stack(hi, 1)], 1)
        self.sizes += [b - a for a, b in spans]
        if config.attend_summaries:
            self.sum_k = torch.cat([self.sum_k, torch.stack(sk, 1)[None]], 2)
            self.sum_v = torch.cat([self.sum_v, torch.stack(sv, 1)[None]], 2)
        self.route = torch.cat([self.route, torch.stack(rt, 1)], 1)
        self.log_n = torch.cat([self.log_n, self.log_n.new_tensor(ln)])

    # -- bytes -----------------------------------------------------------------------------------------
    def kv_nbytes(self) -> int:
        """K/V read by every pass besides expansions: the anchors' and the span summaries'."""
        return sum(t.nbytes for t in (self.anchor_k, self.anchor_v, self.sum_k, self.sum_v))

    def fast_nbytes(self) -> int:
        bounds = 0 if self.k_lo is None or self.k_hi is None else self.k_lo.nbytes + self.k_hi.nbytes
        return self.kv_nbytes() + self.route.nbytes + self.log_n.nbytes + bounds

    def working_nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self._working.values())

    def slow_nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.slow)

    def full_nbytes(self) -> int:
        """Full K/V bytes of every token this layer has seen (anchors and spans cover each once)."""
        return (self.anchor_k.shape[2] + sum(self.sizes)) * self.token_bytes

    def allowance(self, budget: float) -> int:
        """Bytes the expanded spans may take now: ``budget`` x full KV minus the fast tier (never below 0)."""
        return max(0, int(budget * self.full_nbytes()) - self.fast_nbytes())

    # -- decoding ----------------------------------------------------------------------------------------
    def append(self, keys: torch.Tensor, values: torch.Tensor, router: SemanticRouter, layer: int,
               config: SemanticConfig) -> None:
        """Add fed tokens (1, H, t, D) at full resolution; fold the oldest into spans once they leave the window."""
        self.anchor_k = torch.cat([self.anchor_k, keys], 2)
        self.anchor_v = torch.cat([self.anchor_v, values], 2)
        self.n_tail += keys.shape[2]
        seg = config.segment
        while self.n_tail > seg.recent + seg.max_span:
            self._fold(seg.max_span, router, layer, config)
        out = self.n_tail - seg.recent  # fed tokens that left the window
        if config.capped and out >= seg.min_span and self.fast_nbytes() > config.budget * self.full_nbytes():
            self._fold(out, router, layer, config)

    def _fold(self, n: int, router: SemanticRouter, layer: int, config: SemanticConfig) -> None:
        """Fold the oldest ``n`` tail tokens into one span."""
        a = self.anchor_k.shape[2] - self.n_tail
        k, v = self.anchor_k[0, :, a:a + n], self.anchor_v[0, :, a:a + n]
        self._add_spans(k, v, [(0, n)], [torch.full((n,), 1.0 / n)], router, layer, config)
        keep = torch.ones(self.anchor_k.shape[2], dtype=torch.bool)
        keep[a:a + n] = False
        self.anchor_k, self.anchor_v = self.anchor_k[:, :, keep], self.anchor_v[:, :, keep]
        self.n_tail -= n

    def decide(self, query: torch.Tensor, scaling: float, router: SemanticRouter, layer: int,
               config: SemanticConfig) -> tuple[torch.Tensor, torch.Tensor]:
        """Spans each KV head wants and their relevance: query (Hq, Tq, D) → (H, S) bool, (H, S) float."""
        zoom = config.zoom
        h, s = self.sum_k.shape[1], self.n_spans
        if zoom in ("all", "soft", "none") or s == 0:
            return torch.full((h, s), zoom in ("all", "soft")), torch.zeros(h, s)
        g = query.shape[0] // h
        qg = query.reshape(h, -1, query.shape[-1])  # (H, g*Tq, D) the query heads of each KV head
        if zoom == "similarity":  # SentenceKV-like: query . mean key, every span a candidate
            score = (qg @ self.sum_k[0].transpose(-1, -2) * scaling).amax(1).float()  # (H, S)
            return torch.ones(h, s, dtype=torch.bool), score
        if config.routing == "bounds":  # the largest logit a span's keys can give, over the group's queries
            assert self.k_lo is not None and self.k_hi is not None
            score = (upper_bound(qg, self.k_lo, self.k_hi) * scaling).amax(1)  # (H, S)
            return torch.ones(h, s, dtype=torch.bool), score
        z = router.zoom_logits(layer, query, self.route).amax(1)  # (Hq, S): relevance - threshold
        score = z.view(h, g, s).amax(1)  # (H, S)
        return score > 0, score

    def select(self, want: torch.Tensor, score: torch.Tensor, allowance: int | None) -> torch.Tensor:
        """Spans to materialise (S,) bool: wanted ones by relevance (max over heads), most relevant first, while
        their reconstructed K/V (all heads) fit ``allowance`` (None: no cap)."""
        cand = want.any(0)
        if allowance is None:
            return cand
        chosen = torch.zeros_like(cand)
        best = score.masked_fill(~want, float("-inf")).amax(0).tolist()  # (S,)
        idx = torch.nonzero(cand).flatten().tolist()
        idx.sort(key=lambda i: (-best[i], i))
        used = 0
        for i in idx:
            cost = self.sizes[i] * self.token_bytes
            if used + cost <= allowance:
                chosen[i] = True
                used += cost
        return chosen

    def _reconstruct(self, chosen: tuple[int, ...], dtype: torch.dtype,
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Token-level K/V (H, n_exp, D) of the chosen spans and each token's span index (n_exp,); spans already
        in the working set are not reconstructed again."""
        if self._joined is not None and self._joined[0] == chosen:
            return self._joined[1:]
        work = {i: self._working.get(i) or (self._keys_of(i, dtype, device),
                                            self.slow[i][1].reconstruct(dtype, device)) for i in chosen}
        rk = torch.cat([work[i][0] for i in chosen], 1)  # (H, n_exp, D)
        rv = torch.cat([work[i][1] for i in chosen], 1)
        n = [work[i][0].shape[1] for i in chosen]
        owner = torch.repeat_interleave(torch.tensor(chosen), torch.tensor(n))  # (n_exp,) span index of each token
        starts = np.cumsum([0, *n[:-1]]).tolist()
        self._working = {i: (rk[:, o:o + m], rv[:, o:o + m]) for i, o, m in zip(chosen, starts, n, strict=True)}
        self._joined = (chosen, rk, rv, owner)
        return rk, rv, owner

    def attend(self, query: torch.Tensor, scaling: float, router: SemanticRouter, layer: int,
               config: SemanticConfig) -> torch.Tensor:
        """Mixed-resolution attention of the fed tokens' queries (1, Hq, Tq, D) → (1, Hq, Tq, D).

        The last Tq anchor entries are the fed tokens themselves (causal among each other). Query heads
        are grouped per KV head as rows (H, g * Tq) so no key or value is copied per query head.
        """
        zoom = config.zoom
        q = query[0]  # (Hq, Tq, D)
        hq, tq, d = q.shape
        h = self.anchor_k.shape[1]
        g = hq // h
        qg = q.reshape(h, g * tq, d)  # (H, g*Tq, D), rows ordered (group head, token)
        ka, va = self.anchor_k[0], self.anchor_v[0]  # (H, A, D)
        a = ka.shape[1]
        logits = [qg @ ka.transpose(-1, -2) * scaling]  # (H, g*Tq, A)
        if tq > 1:  # one fed token sees every anchor
            causal = (torch.arange(a)[None, :] > torch.arange(a - tq, a)[:, None]).repeat(g, 1)  # (g*Tq, A)
            logits[0] = logits[0].masked_fill(causal, float("-inf"))
        vals = [va]
        with torch.no_grad():
            rq = q.detach() if config.route_query == "all" else q.detach()[:, -1:]  # (Hq, Tq or 1, D)
            want, score = self.decide(rq, scaling, router, layer, config)  # (H, S)
            sticky = config.sticky and config.capped and self.sticky is not None
            if sticky:  # the working set stays a candidate; if it no longer fits, the least relevant goes
                want[:, : self.sticky.shape[1]] |= self.sticky
            chosen = self.select(want, score, self.allowance(config.budget) if config.capped else None)  # (S,)
            expand = want & chosen[None, :]  # (H, S)
            if config.sticky and config.capped:
                self.sticky = expand.clone()
        read = self.kv_nbytes()
        if self.n_spans:
            soft = None
            if config.attend_summaries:  # each unexpanded span as one entry: its mean key with log |S| added, its mean value
                ls = qg @ self.sum_k[0].transpose(-1, -2) * scaling + self.log_n.to(q.dtype)  # (H, g*Tq, S)
                if zoom == "soft":  # summary weighted by 1 - gate, its tokens by gate (training relaxation)
                    soft = torch.sigmoid(router.zoom_logits(layer, q, self.route)).to(q.dtype).reshape(h, g * tq, -1)
                    logits.append(ls + torch.log1p(-soft + 1e-6))
                else:
                    logits.append(ls.masked_fill(expand[:, None, :], float("-inf")))
                vals.append(self.sum_v[0])
            picked = tuple(torch.nonzero(chosen).flatten().tolist())
            if picked:
                rk, rv, owner = self._reconstruct(picked, q.dtype, q.device)
                read += rk.nbytes + rv.nbytes
                le = qg @ rk.transpose(-1, -2) * scaling  # (H, g*Tq, n_exp)
                if soft is not None:
                    logits.append(le + torch.log(soft[:, :, owner] + 1e-6))
                else:
                    logits.append(le.masked_fill(~expand[:, owner][:, None, :], float("-inf")))
                vals.append(rv)
            else:
                self._working, self._joined = {}, None
            n_tok = torch.tensor(self.sizes, dtype=torch.float32)
            self.expanded.append(float((expand.float() * n_tok).sum(1).mean() / n_tok.sum()))
        self.reads.append(read)
        self.full_at.append(self.full_nbytes())
        p = torch.softmax(torch.cat(logits, -1).float(), -1).to(q.dtype)  # (H, g*Tq, A + S + n_exp)
        out = p @ torch.cat(vals, 1)  # (H, g*Tq, D)
        if not (config.sticky and config.capped):  # no working set: what was expanded is dropped, not held
            self._working, self._joined = {}, None
        return out.reshape(1, hq, tq, d)
