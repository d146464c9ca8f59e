"""Side-by-side benchmark: full KV, SEKV, in-project baselines and kvpress presses, one protocol, one budget.

Every method sees the same generated items (:mod:`kvstate.lab.semantic.protocol`): the context is
prefilled and compressed without the question, each question is fed afterwards to a copy of the
compressed cache and its answer decoded greedily (:func:`kvstate.lab.decode.greedy_decode`), then
scored with RULER's metric (``niah_4q``: four questions on one compressed cache). The budget caps what a
method keeps on the device *and* reads per forward pass: ``budget`` x the full KV of the tokens seen
(kvpress: ``compression_ratio = 1 - budget``). Every outcome carries the four byte counts measured from
the tensors (:class:`kvstate.semantic.accounting.ByteCounts`). In-process methods:

- ``full``: ``DynamicCache``;
- ``sekv``: :class:`SemanticCache` with the router (trained one if given), the budgeted sticky working
  set, spans ranked by their key bounds; ``sekv_fresh``: the same deciding afresh at every call (no working
  set); ``sekv_raw``: the slow tier kept raw (rank = full) — the ablation that measures what low rank buys;
  ``sekv_learned``: the paper's learned routing instead of the bounds (the routing ablation). Their
  memory cap, slow tier and bits come from :class:`SekvOptions`;
- ``sentencekv``: a SentenceKV-like sentence-level retrieval, labelled as such — sentences (cut after
  ``.``) are spans whose mean keys stay on the device; the raw sentence K/V is offloaded and the
  sentences whose mean key scores highest against the query are read back within the budget
  (``zoom="similarity"``, ``slow="raw"``);
- ``quest``: a Quest-like query-aware page selection (:mod:`kvstate.lab.semantic.quest`);
- ``streaming``: StreamingLLM-like sinks + rolling window; ``window``: the window only
  (:mod:`kvstate.lab.semantic.window`).

``ppl`` items (held-out perplexity, compress-then-continue) feed their continuation one token at a time
to the compressed cache and score each next token (:func:`kvstate.lab.perplexity.continuation_nll`);
a row's ``score`` is then ``exp(total NLL / scored tokens)`` over its items (lower is better).

kvpress presses run in their own environment (:mod:`kvstate.lab.semantic.baselines_kvpress`).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache

from kvstate.errors import KVStateError
from kvstate.lab import stats
from kvstate.lab.decode import greedy_decode
from kvstate.lab.journal import Journal
from kvstate.lab.perplexity import TextNLL, continuation_nll, pooled_perplexity
from kvstate.lab.scoring import METRIC_FUNCTIONS, extract_answer
from kvstate.lab.semantic.protocol import PPL, Item
from kvstate.semantic.accounting import ByteCounts, evicting_bytes
from kvstate.semantic.attention import semantic_attention
from kvstate.semantic.cache import SemanticCache, SemanticConfig, surprisal
from kvstate.semantic.config import SLOW_BUDGET
from kvstate.semantic.router import SemanticRouter
from kvstate.semantic.segment import Segmentation, SegmentConfig, forced_mask, spans_from_anchors

SEKV_METHODS = ("sekv", "sekv_fresh", "sekv_raw", "sekv_learned")
IN_PROCESS = ("full", *SEKV_METHODS, "sentencekv", "quest", "streaming", "window")
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
    return METRIC_FUNCTIONS[item.metric](extract_answer(prediction), item.answers[q])


def _answer(model: Any, cache: Any, question: list[int], start: int, max_new: int, eos: int,
            tokenizer: Any) -> tuple[str, float, int]:
    """(greedy answer to ``question`` fed after a cache of ``start`` tokens, decode seconds, decode steps)."""
    res = greedy_decode(model, cache, start, max_new, eos, input_ids=question)
    return tokenizer.decode(res.tokens, skip_special_tokens=True), res.decode_s, res.steps


def sentence_segmentation(tokenizer: Any, ids: list[int], config: SegmentConfig) -> Segmentation:
    """SentenceKV-like spans: whole sentences (each ending at a ``.`` token) packed in order into spans of at
    most ``max_span`` tokens (a longer sentence split evenly); sinks, recent window and pieces shorter than
    ``min_span`` stay anchors."""
    period = tokenizer.convert_tokens_to_ids(".")
    forced = forced_mask(len(ids), config)
    free = np.flatnonzero(~forced)
    if not len(free):
        return spans_from_anchors(forced, config)
    lo, hi = int(free[0]), int(free[-1]) + 1
    cuts = [lo, *(i + 1 for i in range(lo, hi - 1) if ids[i] == period), hi]
    spans: list[tuple[int, int]] = []
    for a, b in itertools.pairwise(cuts):  # one sentence [a, b)
        if spans and b - spans[-1][0] <= config.max_span and spans[-1][1] == a:
            spans[-1] = (spans[-1][0], b)  # the sentence joins the open span
        else:
            pieces = -(-(b - a) // config.max_span)
            bounds = [a + ((b - a) * i) // pieces for i in range(pieces + 1)]
            spans += list(itertools.pairwise(bounds))
    kept = [(a, b) for a, b in spans if b - a >= config.min_span]
    mask = np.ones(len(ids), dtype=bool)
    for a, b in kept:
        mask[a:b] = False
    return Segmentation(len(ids), np.flatnonzero(mask).astype(np.int64), np.array(kept, dtype=np.int64).reshape(-1, 2))


@dataclass(frozen=True)
class SekvOptions:
    """SEKV's settings beside the read budget (the same for every SEKV method of a run)."""

    memory: float | None = None  # bytes held in every tier / full KV; None: the slow tier under slow_budget
    slow: str = "lowrank"  # "lowrank" or "quant" (sekv_raw: always raw)
    bits: int = 4  # slow="quant": 2, 4, 8 or 16


def method_config(method: str, budget: float, segment: SegmentConfig, expand_share: float = 0.5,
                  slow_budget: float = SLOW_BUDGET, options: SekvOptions | None = None) -> SemanticConfig:
    """The cache settings of an in-process method at ``budget`` (``full`` has none)."""
    share = {"expand_share": expand_share}
    if method in SEKV_METHODS:
        o = options if options is not None else SekvOptions()
        return SemanticConfig(budget=budget, segment=segment, slow_budget=slow_budget, sticky=method != "sekv_fresh",
                              slow="raw" if method == "sekv_raw" else o.slow, bits=o.bits,  # type: ignore[arg-type]
                              memory=o.memory, routing="learned" if method == "sekv_learned" else "bounds", **share)
    if method == "sentencekv":
        return SemanticConfig(budget=budget, segment=segment, zoom="similarity", slow="raw", sticky=False, **share)
    if method == "window":
        return SemanticConfig(budget=budget, segment=SegmentConfig(sinks=0, recent=segment.recent), zoom="none",
                              slow_tier=False)
    return SemanticConfig(budget=budget, segment=segment, zoom="none", slow_tier=False)  # quest, streaming


@dataclass(frozen=True)
class Prefilled:
    """One item's context prefilled once at full resolution; every method and budget compresses a copy."""

    cache: Any  # DynamicCache(config=model.config) holding the context (never fed afterwards)
    surprisal: torch.Tensor  # (T,) -log p(x_t | x_<t) of each context token, from the prefill logits


@torch.no_grad()
def prefill(model: Any, item: Item) -> Prefilled:
    """Prefill ``item``'s context once (the forward pass every method starts from)."""
    ctx = torch.tensor([item.context])
    cache = DynamicCache(config=model.config)
    logits = model(input_ids=ctx, position_ids=torch.arange(ctx.shape[1])[None], cache=cache, use_cache=True).logits
    return Prefilled(cache, surprisal(logits, ctx))


def compressed_cache(method: str, model: Any, tokenizer: Any, item: Item, budget: float,
                     router: SemanticRouter | None, segment: SegmentConfig,
                     config: SemanticConfig | None = None, expand_share: float = 0.5,
                     slow_budget: float = SLOW_BUDGET, prefilled: Prefilled | None = None,
                     options: SekvOptions | None = None) -> Any:
    """A cache of ``method`` holding ``item``'s context, compressed (``full``: not compressed), from
    ``prefilled`` (:func:`prefill`, left unchanged) or from a prefill of its own."""
    pre = prefilled if prefilled is not None else prefill(model, item)
    if method == "full":
        return copy.deepcopy(pre.cache)
    from kvstate.lab.semantic.quest import QuestCache
    from kvstate.lab.semantic.window import WindowCache

    cfg = config if config is not None and method in SEKV_METHODS else \
        method_config(method, budget, segment, expand_share, slow_budget, options)
    kind = {"quest": QuestCache, "streaming": WindowCache, "window": WindowCache}.get(method, SemanticCache)
    cache = kind(model, router if method in SEKV_METHODS else None, cfg)
    cache.adopt(pre.cache)
    if method in SEKV_METHODS:
        cache.compress(pre.surprisal)
    elif method == "sentencekv":
        seg = sentence_segmentation(tokenizer, item.context, cfg.segment)
        cache.check_fits(seg)
        cache.compress_segmentation(seg, [np.full(b - a, 1.0 / (b - a)) for a, b in seg.spans])
    else:
        cache.compress()
    return cache


def counts(method: str, cache: Any) -> tuple[ByteCounts, float]:
    """Byte counts of a cache after an answer and its peak read ratio (K/V read / full K/V, over passes)."""
    if method == "full":
        return evicting_bytes(cache, cache.get_seq_length()), 1.0
    ratios = cache.read_ratios()
    return cache.byte_counts(), max(ratios) if ratios else 0.0


def _outcome(method: str, budget: float, it: Item, q: int, score: float, pred: str, cache: Any, dt: float,
             steps: int, nll: float | None = None, tokens: int = 0) -> Outcome:
    b, ratio = counts(method, cache)
    expanded = cache.expanded_fraction() if method in (*SEKV_METHODS, "sentencekv", "quest") else None
    return Outcome(method, budget, it.task, it.length, it.index, q, it.depth if it.task != PPL else None, score, pred,
                   b.resident_bytes, b.total_bytes, b.attended_bytes_peak, b.full_bytes, ratio, dt, steps, expanded,
                   nll, tokens)


def _ask(method: str, budget: float, model: Any, tokenizer: Any, it: Item, cache: Any) -> list[Outcome]:
    """Every question of ``it`` (ppl: the continuation) on a fork of one compressed ``cache``, left unchanged."""
    tc = len(it.context)
    if it.task == PPL:  # compress, then continue: one continuation per context
        ids = it.context + it.questions[0]
        if method == "full":
            work = copy.deepcopy(cache)
            got = continuation_nll(model, ids, tc, work, stepwise=True)
        else:
            work = cache.fork()
            with semantic_attention(model):
                got = continuation_nll(model, ids, tc, work, stepwise=True)
        return [_outcome(method, budget, it, 0, pooled_perplexity([got]), "", work, got.seconds, got.tokens,
                         got.nll, got.tokens)]
    out = []
    for qi, (q, mx) in enumerate(zip(it.questions, it.max_new_tokens, strict=True)):
        if method == "full":
            work = copy.deepcopy(cache)
            pred, dt, steps = _answer(model, work, q, tc, mx, tokenizer.eos_token_id, tokenizer)
        else:
            work = cache.fork()  # shares the compressed context's tensors
            with semantic_attention(model):
                pred, dt, steps = _answer(model, work, q, tc, mx, tokenizer.eos_token_id, tokenizer)
        out.append(_outcome(method, budget, it, qi, score_prediction(it, qi, pred), pred, work, dt, steps))
    return out


def _item(runs: Sequence[tuple[str, float]], model: Any, tokenizer: Any, it: Item, router: SemanticRouter | None,
          segment: SegmentConfig, config: SemanticConfig | None, expand_share: float, slow_budget: float,
          failed: dict[int, KVStateError], options: SekvOptions | None = None) -> dict[str, dict[int, Any]]:
    """One item under every run not yet ``failed``: ``{"outcomes": {run: [...]}, "logs": {run: [...]},
    "failed": {run: error}}`` (a run whose compression failed on this item stops here)."""
    pre = prefill(model, it)
    shared: dict[SemanticConfig, SemanticCache] = {}  # sekv and sekv_fresh differ in sticky only
    rec: dict[str, dict[int, Any]] = {"outcomes": {}, "logs": {}, "failed": {}}
    for r, (method, budget) in enumerate(runs):
        if r in failed:
            continue
        cfg = (config if config is not None else method_config(method, budget, segment, expand_share,
                                                               slow_budget, options)) if method in SEKV_METHODS else None
        # without a memory cap, sticky is the one setting compression does not read
        key = (dataclasses.replace(cfg, sticky=False) if cfg.memory is None else cfg) if cfg is not None else None
        try:
            cache = shared[key].fork(cfg) if key in shared else \
                compressed_cache(method, model, tokenizer, it, budget, router, segment, cfg, expand_share,
                                 slow_budget, prefilled=pre)
        except KVStateError as exc:  # e.g. a budget below the method's minimum: the run stops
            rec["failed"][r] = exc
            continue
        if key is not None:
            shared.setdefault(key, cache)
        if method in SEKV_METHODS:
            rec["logs"][r] = [{"method": method, "budget": budget, "task": it.task, "length": it.length,
                               "index": it.index, **cache.slow_tier()}]
        rec["outcomes"][r] = _ask(method, budget, model, tokenizer, it, cache)
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
        if method not in IN_PROCESS:
            raise ValueError(f"unknown in-process method {method!r}; choose from {IN_PROCESS}")
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
                expand_share: float = 0.5, slow_budget: float = SLOW_BUDGET, journal: Journal | None = None,
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
               slow_log: list[dict[str, Any]] | None = None, expand_share: float = 0.5,
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
