"""Side-by-side benchmark: full KV, SEKV, in-project baselines and kvpress presses, one protocol, one budget.

Every method sees the same generated items (:mod:`kvstate.lab.semantic.protocol`): the context is
prefilled and compressed without the question, each question is fed afterwards to a copy of the
compressed cache and its answer decoded greedily (:func:`kvstate.lab.decode.greedy_decode`), then
scored with RULER's metric (``niah_4q``: four questions on one compressed cache). The budget caps what a
method keeps on the device *and* reads per forward pass: ``budget`` x the full KV of the tokens seen
(kvpress: ``compression_ratio = 1 - budget``). Every outcome carries the four byte counts measured from
the tensors (:class:`kvstate.semantic.accounting.ByteCounts`).

The methods are registered objects, one module each (:mod:`kvstate.lab.semantic.methods`): this loop knows
none by name. It asks the registry for a method, lets it build its compressed cache from the item's one
prefill (runs whose :meth:`~kvstate.lab.semantic.methods.Method.share_key` agree share one compression),
forks it per question and reads its byte counts; kvpress presses run through the registry's adapter.

``ppl`` items (held-out perplexity, compress-then-continue) feed their continuation one token at a time
to the compressed cache and score each next token (:func:`kvstate.lab.perplexity.continuation_nll`);
a row's ``score`` is then ``exp(total NLL / scored tokens)`` over its items (lower is better).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvstate.errors import KVStateError
from kvstate.lab import stats
from kvstate.lab.decode import greedy_decode
from kvstate.lab.journal import Journal
from kvstate.lab.perplexity import TextNLL, continuation_nll, pooled_perplexity
from kvstate.lab.scoring import METRIC_FUNCTIONS, extract_answer, string_match_all
from kvstate.lab.semantic import methods
from kvstate.lab.semantic.methods import Context, Prefilled, SekvOptions
from kvstate.lab.semantic.protocol import PPL, REAL_METRIC, Item
from kvstate.semantic.cache import SemanticConfig
from kvstate.semantic.config import SLOW_BUDGET
from kvstate.semantic.router import SemanticRouter
from kvstate.semantic.segment import SegmentConfig

__all__ = ["ROW_FIELDS", "Outcome", "Prefilled", "SekvOptions", "cells", "compressed_cache", "prefill", "run_method",
           "run_methods", "score_prediction", "slow_summary", "summarise"]
ROW_FIELDS = ("method", "budget", "task", "length", "n", "score", "score_ci", "resident_bytes", "total_bytes",
              "attended_bytes_peak", "full_bytes", "expanded_fraction", "decode_ms_per_token")


@dataclass(frozen=True)
class Outcome:
    """One question answered under one method."""

    method: str
    budget: float
    task: str
    length: int
    index: int
    question: int
    depth: float | None
    score: float
    prediction: str
    resident_bytes: int  # on the device after the answer (kept K/V, summaries, metadata, working set)
    total_bytes: int  # every tier after the answer
    attended_bytes_peak: int  # largest K/V read by one forward pass while answering
    full_bytes: int  # full K/V of the tokens seen (context, question, answer)
    read_ratio_peak: float  # max over the passes of (K/V read / full K/V of the tokens seen then)
    decode_s: float  # wall time of the single-token decode steps
    decode_steps: int
    expanded: float | None  # SEKV / Quest / SentenceKV: mean fraction of span (page) tokens read at full resolution
    nll: float | None = None  # ppl items: summed next-token NLL of the continuation (nats)
    tokens: int = 0  # ppl items: continuation tokens scored


def score_prediction(item: Item, q: int, prediction: str) -> float:
    if item.metric == REAL_METRIC:  # a real-text reply: every answer anywhere in it (as the reference table)
        return string_match_all(prediction, item.answers[q])
    return METRIC_FUNCTIONS[item.metric](extract_answer(prediction), item.answers[q])


def _answer(model: Any, cache: Any, question: list[int], start: int, max_new: int, eos: int,
            tokenizer: Any) -> tuple[str, float, int]:
    """(greedy answer to ``question`` fed after a cache of ``start`` tokens, decode seconds, decode steps)."""
    res = greedy_decode(model, cache, start, max_new, eos, input_ids=question)
    return tokenizer.decode(res.tokens, skip_special_tokens=True), res.decode_s, res.steps


@torch.no_grad()
def prefill(model: Any, item: Item) -> Prefilled:
    """Prefill ``item``'s context once (the forward pass every method starts from)."""
    return methods.prefill(model, item.context)


def _context(router: SemanticRouter | None, segment: SegmentConfig, expand_share: float, slow_budget: float,
             options: SekvOptions | None, config: SemanticConfig | None = None) -> Context:
    return Context(router, segment, expand_share, slow_budget, options if options is not None else SekvOptions(),
                   config)


def compressed_cache(method: str, model: Any, tokenizer: Any, item: Item, budget: float,
                     router: SemanticRouter | None, segment: SegmentConfig,
                     config: SemanticConfig | None = None, expand_share: float = 0.6,
                     slow_budget: float = SLOW_BUDGET, prefilled: Prefilled | None = None,
                     options: SekvOptions | None = None) -> Any:
    """A cache of ``method`` holding ``item``'s context, compressed (``full``: not compressed), from
    ``prefilled`` (:func:`prefill`, left unchanged) or from a prefill of its own; ``config`` replaces the
    proposed method's settings."""
    pre = prefilled if prefilled is not None else prefill(model, item)
    ctx = _context(router, segment, expand_share, slow_budget, options, config)
    return methods.get(method).build(model, tokenizer, item.context, budget, ctx, pre)


def _outcome(method: str, budget: float, it: Item, q: int, score: float, pred: str, cache: Any, dt: float,
             steps: int, nll: float | None = None, tokens: int = 0) -> Outcome:
    m = methods.get(method)
    b, ratio = m.counts(cache)
    expanded = m.expanded(cache)
    return Outcome(method, budget, it.task, it.length, it.index, q, it.depth if it.task != PPL else None, score, pred,
                   b.resident_bytes, b.total_bytes, b.attended_bytes_peak, b.full_bytes, ratio, dt, steps, expanded,
                   nll, tokens)


def _ask(method: str, budget: float, model: Any, tokenizer: Any, it: Item, cache: Any, ctx: Context) -> list[Outcome]:
    """Every question of ``it`` (ppl: the continuation) on a fork of one compressed ``cache``, left unchanged."""
    m = methods.get(method)
    tc = len(it.context)
    if it.task == PPL:  # compress, then continue: one continuation per context
        ids = it.context + it.questions[0]
        work = m.fork(cache, budget, ctx)
        with m.attention(model):
            got = continuation_nll(model, ids, tc, work, stepwise=True)
        return [_outcome(method, budget, it, 0, pooled_perplexity([got]), "", work, got.seconds, got.tokens,
                         got.nll, got.tokens)]
    out = []
    for qi, (q, mx) in enumerate(zip(it.questions, it.max_new_tokens, strict=True)):
        work = m.fork(cache, budget, ctx)  # a compressed cache's fork shares its tensors
        with m.attention(model):
            pred, dt, steps = _answer(model, work, q, tc, mx, tokenizer.eos_token_id, tokenizer)
        out.append(_outcome(method, budget, it, qi, score_prediction(it, qi, pred), pred, work, dt, steps))
    return out


def _item(runs: Sequence[tuple[str, float]], model: Any, tokenizer: Any, it: Item, router: SemanticRouter | None,
          segment: SegmentConfig, config: SemanticConfig | None, expand_share: float, slow_budget: float,
          failed: dict[int, KVStateError], options: SekvOptions | None = None) -> dict[str, dict[int, Any]]:
    """One item under every run not yet ``failed``: ``{"outcomes": {run: [...]}, "logs": {run: [...]},
    "failed": {run: error}}`` (a run whose compression failed on this item stops here)."""
    pre = prefill(model, it)
    ctx = _context(router, segment, expand_share, slow_budget, options, config)
    shared: dict[Hashable, Any] = {}  # e.g. sekv and sekv_fresh differ in sticky only
    rec: dict[str, dict[int, Any]] = {"outcomes": {}, "logs": {}, "failed": {}}
    for r, (method, budget) in enumerate(runs):
        if r in failed:
            continue
        m = methods.get(method)
        key = m.share_key(budget, ctx)
        try:
            cache = m.fork(shared[key], budget, ctx) if key is not None and key in shared else \
                m.build(model, tokenizer, it.context, budget, ctx, pre)
        except KVStateError as exc:  # e.g. a budget below the method's minimum: the run stops
            rec["failed"][r] = exc
            continue
        if key is not None:
            shared.setdefault(key, cache)
        log = m.slow_log(cache)
        if log is not None:
            rec["logs"][r] = [{"method": method, "budget": budget, "task": it.task, "length": it.length,
                               "index": it.index, **log}]
        rec["outcomes"][r] = _ask(method, budget, model, tokenizer, it, cache, ctx)
    return rec


def _unit(it: Item) -> str:
    return f"{it.task}/{it.length}/{it.index}"


def _encode(rec: dict[str, dict[int, Any]]) -> dict[str, Any]:
    return {"outcomes": {str(r): [dataclasses.asdict(o) for o in g] for r, g in rec["outcomes"].items()},
            "logs": {str(r): g for r, g in rec["logs"].items()},
            "failed": {str(r): str(exc) for r, exc in rec["failed"].items()}}


def _decode(rec: dict[str, Any]) -> dict[str, dict[int, Any]]:
    return {"outcomes": {int(r): [Outcome(**o) for o in g] for r, g in rec["outcomes"].items()},
            "logs": {int(r): g for r, g in rec["logs"].items()},
            "failed": {int(r): KVStateError(msg) for r, msg in rec["failed"].items()}}


@torch.no_grad()
def _run(runs: Sequence[tuple[str, float]], model: Any, tokenizer: Any, items: Sequence[Item],
         router: SemanticRouter | None, segment: SegmentConfig, progress: Callable[[], None] | None,
         config: SemanticConfig | None, slow_log: list[dict[str, Any]] | None, expand_share: float,
         slow_budget: float, journal: Journal | None = None,
         options: SekvOptions | None = None) -> tuple[list[Outcome], dict[int, KVStateError]]:
    """Outcomes of every (method, budget) run in run order, and the error that stopped each failed run."""
    for method, _ in runs:
        methods.get(method)  # an unknown name: one error listing the registry
    got: list[list[Outcome]] = [[] for _ in runs]
    logs: list[list[dict[str, Any]]] = [[] for _ in runs]
    failed: dict[int, KVStateError] = {}
    for it in items:  # item-major: one prefill per item, shared by every run
        done = journal.get(_unit(it)) if journal is not None else None
        if done is not None:
            rec = _decode(done)
        else:
            rec = _item(runs, model, tokenizer, it, router, segment, config, expand_share, slow_budget, failed,
                        options)
            if journal is not None:
                journal.put(_unit(it), _encode(rec))
        for r, exc in rec["failed"].items():
            failed.setdefault(r, exc)
        for r, g in rec["outcomes"].items():
            got[r] += g
        for r, g in rec["logs"].items():
            logs[r] += g
        if progress is not None:
            for _ in runs:
                progress()
    if slow_log is not None:
        slow_log += [e for r, log in enumerate(logs) if r not in failed for e in log]
    return [o for r, g in enumerate(got) if r not in failed for o in g], failed


def run_methods(runs: Sequence[tuple[str, float]], model: Any, tokenizer: Any, items: Sequence[Item],
                router: SemanticRouter | None, segment: SegmentConfig,
                progress: Callable[[], None] | None = None, slow_log: list[dict[str, Any]] | None = None,
                expand_share: float = 0.6, slow_budget: float = SLOW_BUDGET, journal: Journal | None = None,
                options: SekvOptions | None = None) -> tuple[list[Outcome], list[dict[str, Any]]]:
    """Answer every question of ``items`` under every in-process (method, budget) of ``runs``.

    Each item's context is prefilled once and compressed per run; each question is asked of a fork of the
    compressed cache. Returns the outcomes in run order (as :func:`run_method` run by run) and the runs that
    could not run (a budget below a method's minimum), as ``{"method", "budget", "reason"}``; ``progress``
    is called once per run and item. With a ``journal`` (:mod:`kvstate.lab.journal`) each finished item is
    recorded and an item already there is read back instead of run again.
    """
    outcomes, failed = _run(runs, model, tokenizer, items, router, segment, progress, None, slow_log, expand_share,
                            slow_budget, journal, options)
    return outcomes, [{"method": runs[r][0], "budget": runs[r][1], "reason": str(exc)} for r, exc in failed.items()]


def run_method(method: str, model: Any, tokenizer: Any, items: Sequence[Item], budget: float,
               router: SemanticRouter | None, segment: SegmentConfig,
               progress: Callable[[], None] | None = None, config: SemanticConfig | None = None,
               slow_log: list[dict[str, Any]] | None = None, expand_share: float = 0.6,
               slow_budget: float = SLOW_BUDGET) -> list[Outcome]:
    """Answer every question of ``items`` under one in-process method at one budget (a failed run raises).

    ``config`` replaces SEKV's cache settings (e.g. ``zoom="all"`` at full rank: the exact oracle);
    ``expand_share`` / ``slow_budget`` otherwise set the share of the budget kept for reads and the slow tier;
    ``slow_log`` receives each SEKV cache's slow tier (bytes, rank and cap histograms) after compression.
    """
    outcomes, failed = _run([(method, budget)], model, tokenizer, items, router, segment, progress, config, slow_log,
                            expand_share, slow_budget)
    if failed:
        raise failed[0]
    return outcomes


def _score_ci(task: str, g: Sequence[Outcome]) -> stats.Estimate:
    if task == PPL:
        return stats.perplexity([o.nll or 0.0 for o in g], [max(o.tokens, 1) for o in g])
    return stats.rate([o.score for o in g])


def summarise(outcomes: Sequence[Outcome]) -> list[dict[str, Any]]:
    """One row per (method, budget, task, length), exactly :data:`ROW_FIELDS`: ``n`` questions (texts for
    ``ppl``), the score with its 95% interval (:mod:`kvstate.lab.stats`), mean byte counts per question."""
    groups: dict[tuple[str, float, str, int], list[Outcome]] = {}
    for o in outcomes:
        groups.setdefault((o.method, o.budget, o.task, o.length), []).append(o)
    rows = []
    for (method, budget, task, length), g in groups.items():
        steps = sum(o.decode_steps for o in g)
        exp = [o.expanded for o in g if o.expanded is not None]
        ppl = pooled_perplexity(TextNLL(o.nll or 0.0, o.tokens, o.decode_s) for o in g) if task == PPL else None
        est = _score_ci(task, g)
        rows.append({"method": method, "budget": budget, "task": task, "length": length, "n": len(g),
                     "score": round(ppl, 4) if ppl is not None else round(float(np.mean([o.score for o in g])), 4),
                     "score_ci": [round(est.lo, 4), round(est.hi, 4)],
                     **{f: int(np.mean([getattr(o, f) for o in g]))
                        for f in ("resident_bytes", "total_bytes", "attended_bytes_peak", "full_bytes")},
                     "expanded_fraction": round(float(np.mean(exp)), 4) if exp else None,
                     "decode_ms_per_token": round(1000 * sum(o.decode_s for o in g) / max(steps, 1), 3)})
    return rows


def cells(outcomes: Sequence[Outcome]) -> list[dict[str, Any]]:
    """Per-question results (the length x depth heatmap, paired comparisons, the per-item budget check)."""
    return [{"method": o.method, "budget": o.budget, "task": o.task, "length": o.length, "index": o.index,
             "question": o.question, "depth": o.depth, "score": o.score, "attended_bytes_peak": o.attended_bytes_peak,
             "full_bytes": o.full_bytes, "read_ratio_peak": round(o.read_ratio_peak, 6)} for o in outcomes]


def slow_summary(log: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The slow tier per (method, budget, length): bytes against the budget and the rank / cap histograms of
    every span's keys and values over its items."""
    groups: dict[tuple[str, float, int], dict[str, Any]] = {}
    for e in log:
        g = groups.setdefault((e["method"], e["budget"], e["length"]), {
            "method": e["method"], "budget": e["budget"], "length": e["length"], "items": 0, "slow_bytes": 0,
            "raw_span_bytes": 0, "budget_bytes": 0, "rank_histogram": {}, "cap_histogram": {}})
        g["items"] += 1
        for k in ("slow_bytes", "raw_span_bytes", "budget_bytes"):
            g[k] += e[k]
        for k in ("rank_histogram", "cap_histogram"):
            for r, c in e[k].items():
                g[k][str(r)] = g[k].get(str(r), 0) + c
    return list(groups.values())
