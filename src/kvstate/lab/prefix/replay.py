"""Replay a request trace through :class:`SparsePrefixCache` on a real model, against no cache and the offline prediction.

Sparse prefix caching ("Sparse Prefix Caching for Hybrid and Recurrent LLM Serving") is evaluated in
the paper offline, from overlap histograms. This replays the requests themselves: each prompt is served
by the engine (one transaction per request) and, separately, prefilled with no cache; per request it
records tokens reused / recomputed / lost and both wall-clock times. Each prompt is served the way a server
with its own decode loop serves it (``prefill(..., full_state=True)``: the cache after all its tokens and
the last logits, what the plain prefill returns too). The offline prediction is what the
placement evaluation (``evaluate.py``) expects for the same trace: one plan on the pooled histogram of
true overlap depths (the longest common prefix with any earlier request), each request saving the
deepest planned position at or below its overlap; it assumes every planned checkpoint fits the budget.
Requests are served one at a time (batch of one).

Replicas: ``replicas=R, remote=URL`` serves the requests round-robin over ``R`` engines that share one
Redis tier (``PrefixCacheConfig.remote``); tokens reused are then what each request restored, locally or
from the tier. ``repeats=K`` times the whole trace ``K`` times with a fresh cache and ``K`` times with no
cache, interleaved (the order alternates), and reports the medians and the spread of the per-repeat
ratio; with a remote tier its database is flushed before each cached repeat (pass a scratch database).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import torch

from kvstate.errors import TraceFormatError
from kvstate.lab.workloads.traces import Request
from kvstate.models import segmented_prefill
from kvstate.prefix.config import PrefixCacheConfig
from kvstate.prefix.engine import SparsePrefixCache
from kvstate.prefix.placement import Placement, plan_checkpoints
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
    placement: Placement = Placement.PATH  # PATH (one plan per request path) or TREE (exact DP over the radix tree)
    replicas: int = 1  # engines serving the requests round-robin (sharing `remote`)
    remote_hits: int = 0  # local misses resumed from the shared tier (all replicas)
    remote_tokens_reused: int = 0  # tokens those restored beyond the local hit
    declared: bool = False  # requests declared their boundaries (declared_boundaries)
    repeats: int = 1  # interleaved timing repeats; wall_s / wall_s_no_cache are their medians
    wall_ratio: float = float("nan")  # median over repeats of (no cache / cache) wall time
    wall_ratio_min: float = float("nan")  # the spread of that ratio over repeats
    wall_ratio_max: float = float("nan")

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


def declared_boundaries(token_lists: list[tuple[int, ...]]) -> list[list[int]]:
    """What an application would declare per request: where it parts from the other requests of the trace
    (the longest common prefix with any earlier and with any later request: a document's or a system
    prompt's end), each in ``1..len - 1``."""
    before = true_overlaps(token_lists)
    after = true_overlaps(token_lists[::-1])[::-1]
    return [sorted({b for b in (x, y) if 0 < b < len(t)}) for t, x, y in zip(token_lists, before, after, strict=True)]


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


def _flush(remote: str) -> None:
    import redis

    redis.Redis.from_url(remote, socket_timeout=5).flushdb()


def _serve_all(
    engines: list[SparsePrefixCache], tokens: list[tuple[int, ...]], device: Any, marks: list[list[int]] | None
) -> tuple[list[Any], list[float]]:
    results, times = [], []
    for i, toks in enumerate(tokens):
        ids = torch.tensor([toks], device=device)
        t0 = time.perf_counter()
        results.append(
            engines[i % len(engines)].prefill(ids, boundaries=marks[i] if marks else None, full_state=True)
        )
        times.append(time.perf_counter() - t0)
    return results, times


def _no_cache(model: Any, tokens: list[tuple[int, ...]], device: Any) -> list[float]:
    times = []
    for toks in tokens:
        ids = torch.tensor([toks], device=device)
        t0 = time.perf_counter()
        segmented_prefill(model, ids, capture=None)
        times.append(time.perf_counter() - t0)
    return times


@torch.no_grad()
def replay(
    model: Any,
    requests: Iterable[Request],
    config: PrefixCacheConfig,
    *,
    no_cache_baseline: bool = True,
    baseline_s: list[float] | None = None,
    progress: Callable[[int], None] | None = None,
    replicas: int = 1,
    remote: str | None = None,
    repeats: int = 1,
    declare: bool = False,
) -> ReplayResult:
    """Serve every request through a fresh cache (and, by default, with no cache); see the module docstring.
    ``baseline_s``: no-cache wall-clock per request measured by an earlier replay of the same trace.
    ``declare``: each request declares :func:`declared_boundaries` (``prefill(..., boundaries=...)``)."""
    if replicas < 1 or repeats < 1:
        raise TraceFormatError(f"replicas={replicas} and repeats={repeats} must be >= 1.")
    if replicas > 1 and remote is None and config.remote is None:
        raise TraceFormatError(f"replicas={replicas} need a shared tier: pass remote='redis://HOST:PORT/DB'.")
    if remote is not None:
        config = replace(config, remote=remote)
    reqs = list(requests)
    vocab = int(model.get_output_embeddings().weight.shape[0])
    tokens = check_vocab(reqs, vocab)
    device = next(model.parameters()).device
    if baseline_s is not None and len(baseline_s) != len(tokens):
        raise TraceFormatError(f"baseline_s has {len(baseline_s)} times for {len(tokens)} requests.")
    marks = declared_boundaries(tokens) if declare else None
    walls, walls0, first = [], [], None
    engines: list[SparsePrefixCache] = []
    for k in range(repeats):
        times0: list[float] | None = None
        if no_cache_baseline and baseline_s is None and k % 2 == 1:  # alternate which goes first
            times0 = _no_cache(model, tokens, device)
        if config.remote is not None:
            _flush(config.remote)
        engines = [SparsePrefixCache(model, config) for _ in range(replicas)]
        results, times = _serve_all(engines, tokens, device, marks)
        if no_cache_baseline and baseline_s is None and k % 2 == 0:
            times0 = _no_cache(model, tokens, device)
        if baseline_s is not None:
            times0 = list(baseline_s)
        walls.append(sum(times))
        walls0.append(sum(times0) if times0 is not None else 0.0)
        if first is None:
            first = (results, times, times0, engines)
        if progress is not None:
            progress(len(tokens) // repeats if k else len(tokens) - (len(tokens) // repeats) * (repeats - 1))
    assert first is not None
    results, times, times0, engines = first
    rows = [
        {
            "reused": r.reused_tokens,
            "length": len(toks),
            "wall_s": dt,
            "wall_s_no_cache": times0[i] if times0 is not None else 0.0,
        }
        for i, (r, toks, dt) in enumerate(zip(results, tokens, times, strict=True))
    ]
    ms = [e.metrics for e in engines]
    rms = [e.remote_metrics for e in engines]
    peak: dict[str, int] = {}
    for e in engines:
        for kind, b in e.bytes_by_kind().items():
            peak[kind] = peak.get(kind, 0) + b
    held = [_kv_held(e) for e in engines]
    saved = [r["wall_s_no_cache"] - r["wall_s"] for r in rows]
    ratios = [b / a for a, b in zip(walls, walls0, strict=True) if a > 0 and b > 0]
    reused = sum(r.reused_tokens for r in results)
    total = sum(len(t) for t in tokens)
    return ReplayResult(
        planner=config.planner,
        placement=config.placement,
        slots=config.slots_per_entry,
        budget_bytes=config.budget_bytes,
        requests=len(tokens),
        tokens_total=total,
        tokens_reused=reused,
        tokens_recomputed=total - reused,
        tokens_lost=sum(r.lost_tokens for r in results),
        hit_rate=sum(r.reused_tokens > 0 for r in results) / len(tokens) if tokens else 0.0,
        predicted_reused=predicted_reused(tokens, config.slots_per_entry, config.planner, engines[0].align),
        peak_bytes=sum(m.peak_bytes for m in ms),
        peak_bytes_by_kind=peak,
        evicted_nodes=sum(m.evicted_nodes for m in ms),
        evicted_states=sum(m.evicted_states for m in ms),
        rejected_inserts=sum(m.rejected_inserts for m in ms),
        kv_bytes_held=sum(h for h, _ in held),
        kv_bytes_distinct=sum(d for _, d in held),
        wall_s=statistics.median(walls),
        wall_s_no_cache=statistics.median(walls0),
        saved_r2=_r2([r["reused"] for r in rows], saved) if no_cache_baseline or baseline_s else float("nan"),
        per_request=rows,
        replicas=replicas,
        remote_hits=sum(m.hits for m in rms if m is not None),
        remote_tokens_reused=sum(m.tokens_reused for m in rms if m is not None),
        repeats=repeats,
        declared=declare,
        wall_ratio=statistics.median(ratios) if ratios else float("nan"),
        wall_ratio_min=min(ratios) if ratios else float("nan"),
        wall_ratio_max=max(ratios) if ratios else float("nan"),
    )
