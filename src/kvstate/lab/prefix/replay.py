"""Replay a request trace through :class:`SparsePrefixCache` on a real model, against no cache and the offline prediction.

Sparse prefix caching ("Sparse Prefix Caching for Hybrid and Recurrent LLM Serving") is evaluated in
the paper offline, from overlap histograms. This replays the requests themselves: each prompt is served
by the engine (one transaction per request) and, separately, prefilled with no cache; per request it
records tokens reused / recomputed / lost and both wall-clock times. The offline prediction is what the
placement evaluation (``evaluate.py``) expects for the same trace: one plan on the pooled histogram of
true overlap depths (the longest common prefix with any earlier request), each request saving the
deepest planned position at or below its overlap; it assumes every planned checkpoint fits the budget.
Requests are served one at a time (batch of one).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from kvstate.errors import TraceFormatError
from kvstate.lab.workloads.traces import Request
from kvstate.models import segmented_prefill
from kvstate.prefix.config import PrefixCacheConfig
from kvstate.prefix.engine import SparsePrefixCache
from kvstate.prefix.placement import plan_checkpoints
from kvstate.prefix.segments import KVSegment


@dataclass(frozen=True)
class ReplayResult:
    planner: str
    slots: int
    budget_bytes: int
    requests: int
    tokens_total: int
    tokens_reused: int
    tokens_recomputed: int
    tokens_lost: int  # the tree held them but no recurrent state did
    hit_rate: float
    predicted_reused: int  # the offline evaluation's prediction for the same trace (see module docstring)
    peak_bytes: int
    peak_bytes_by_kind: dict[str, int]
    evicted_nodes: int
    evicted_states: int
    rejected_inserts: int
    kv_bytes_held: int  # attention KV tensors held at the end, each storage once
    kv_bytes_distinct: int  # KV of the distinct tokens in the tree at the end
    wall_s: float  # engine, all requests
    wall_s_no_cache: float  # one plain prefill per request
    saved_r2: float  # R² of per-request wall-clock saved against tokens reused (linear fit)
    per_request: list[dict[str, float]] = field(default_factory=list, repr=False)
    placement: str = "path"  # "path" (one plan per request path) or "tree" (exact DP over the radix tree)

    def as_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("per_request")
        return d


def true_overlaps(token_lists: list[tuple[int, ...]]) -> list[int]:
    """For each request, the longest common prefix with any earlier request (a trie walk, O(total tokens))."""
    root: dict[int, Any] = {}
    out = []
    for toks in token_lists:
        node, depth = root, 0
        for t in toks:
            if t not in node:
                break
            node, depth = node[t], depth + 1
        out.append(depth)
        node = root
        for t in toks:
            node = node.setdefault(t, {})
    return out


def predicted_reused(token_lists: list[tuple[int, ...]], slots: int, planner: str, align: int) -> int:
    """Tokens the offline evaluation expects to reuse: one plan on the pooled overlap histogram."""
    overlaps = true_overlaps(token_lists)
    n = max(len(t) for t in token_lists)
    w = np.zeros(n + 1)
    for t in overlaps:
        w[t] += 1.0
    if w[1:].sum() <= 0 or slots == 0 or n < align:
        return 0
    positions = np.asarray(plan_checkpoints(w, slots, planner, align), dtype=np.int64)
    total = 0
    for t in overlaps:
        below = positions[positions <= t]
        total += int(below.max()) if below.size else 0
    return total


def check_vocab(requests: list[Request], vocab: int) -> list[tuple[int, ...]]:
    out = []
    for i, r in enumerate(requests, 1):
        if r.tokens is None:
            raise TraceFormatError(
                f"request {i}: no 'tokens'; replay needs token ids (overlap-only lines cannot run)."
            )
        bad = [t for t in r.tokens if t >= vocab]
        if bad:
            raise TraceFormatError(
                f"request {i}: token id {max(bad)} is outside the model's vocabulary (size {vocab}); generate the "
                f"trace with vocab={vocab} (kvstate prefix trace --vocab {vocab})."
            )
        out.append(r.tokens)
    return out


def _kv_held(cache: SparsePrefixCache) -> tuple[int, int]:
    seen: dict[int, int] = {}
    distinct = 0
    for v in cache.store.nodes():
        distinct += len(v.edge)
        if isinstance(v.kv, KVSegment):
            for kv in v.kv.layers:
                for t in kv or ():
                    s = t.untyped_storage()
                    seen[s.data_ptr()] = s.nbytes()
    per_token = cache.store.config.kv_bytes_per_token if cache.store.config.has_attention else 0
    return sum(seen.values()), distinct * per_token


def _r2(x: list[float], y: list[float]) -> float:
    xa, ya = np.asarray(x), np.asarray(y)
    if len(xa) < 3 or np.ptp(xa) == 0:
        return float("nan")
    slope, icpt = np.polyfit(xa, ya, 1)
    resid = ya - (slope * xa + icpt)
    total = float(((ya - ya.mean()) ** 2).sum())
    return 1.0 - float((resid**2).sum()) / total if total > 0 else float("nan")


@torch.no_grad()
def replay(
    model: Any,
    requests: Iterable[Request],
    config: PrefixCacheConfig,
    *,
    no_cache_baseline: bool = True,
    baseline_s: list[float] | None = None,
    progress: Callable[[int], None] | None = None,
) -> ReplayResult:
    """Serve every request through a fresh cache (and, by default, with no cache); see the module docstring.
    ``baseline_s``: no-cache wall-clock per request measured by an earlier replay of the same trace."""
    reqs = list(requests)
    vocab = int(model.get_output_embeddings().weight.shape[0])
    tokens = check_vocab(reqs, vocab)
    cache = SparsePrefixCache(model, config)
    device = next(model.parameters()).device
    peak: dict[str, int] = {}
    rows: list[dict[str, float]] = []
    wall = wall0 = 0.0
    if baseline_s is not None and len(baseline_s) != len(tokens):
        raise TraceFormatError(f"baseline_s has {len(baseline_s)} times for {len(tokens)} requests.")
    for i, toks in enumerate(tokens):
        ids = torch.tensor([toks], device=device)
        t0 = time.perf_counter()
        res = cache.prefill(ids)
        dt = time.perf_counter() - t0
        wall += dt
        dt0 = baseline_s[i] if baseline_s is not None else 0.0
        wall0 += dt0 if baseline_s is not None else 0.0
        if no_cache_baseline and baseline_s is None:
            t0 = time.perf_counter()
            segmented_prefill(model, ids, capture=None)
            dt0 = time.perf_counter() - t0
            wall0 += dt0
        for k, b in cache.bytes_by_kind().items():
            peak[k] = max(peak.get(k, 0), b)
        rows.append({"reused": res.reused_tokens, "length": len(toks), "wall_s": dt, "wall_s_no_cache": dt0})
        if progress is not None:
            progress(1)
    m = cache.metrics
    held, distinct = _kv_held(cache)
    saved = [r["wall_s_no_cache"] - r["wall_s"] for r in rows]
    return ReplayResult(
        planner=config.planner,
        placement=config.placement,
        slots=config.slots_per_entry,
        budget_bytes=config.budget_bytes,
        requests=m.requests,
        tokens_total=m.tokens_total,
        tokens_reused=m.tokens_reused,
        tokens_recomputed=m.tokens_recomputed,
        tokens_lost=m.tokens_lost_to_missing_checkpoint,
        hit_rate=m.hit_rate,
        predicted_reused=predicted_reused(tokens, config.slots_per_entry, config.planner, cache.align),
        peak_bytes=m.peak_bytes,
        peak_bytes_by_kind=peak,
        evicted_nodes=m.evicted_nodes,
        evicted_states=m.evicted_states,
        rejected_inserts=m.rejected_inserts,
        kv_bytes_held=held,
        kv_bytes_distinct=distinct,
        wall_s=wall,
        wall_s_no_cache=wall0,
        saved_r2=_r2([r["reused"] for r in rows], saved) if no_cache_baseline or baseline_s else float("nan"),
        per_request=rows,
    )
