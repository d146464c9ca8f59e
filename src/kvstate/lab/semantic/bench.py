"""Side-by-side benchmark: full KV, SEKV, in-project baselines and kvpress presses, one protocol.

Every method sees the same generated items (:mod:`kvstate.lab.semantic.protocol`): the context is
prefilled and compressed without the question, each question is fed afterwards to a copy of the
compressed cache and its answer decoded greedily (:func:`kvstate.lab.decode.greedy_decode`), then
scored with RULER's metric. The budget is the fast-tier bytes relative to the full KV of the context,
the same for every method (kvpress: its ``compression_ratio`` = 1 - budget). In-process methods:

- ``full``: ``DynamicCache``;
- ``sekv``: :class:`SemanticCache` with the router (trained one if given);
- ``sentencekv``: a SentenceKV-like static semantic grouping, labelled as such — spans are sentences
  (cut at ``.``), kept as summaries only and never expanded, anchors fill the budget by sentence
  starts then recency; it runs through the same cache with ``zoom="none"``;
- ``quest``: a Quest-like query-aware page selection (:mod:`kvstate.lab.semantic.quest`), labelled as such.

``ppl`` items (held-out perplexity, compress-then-continue) feed their continuation one token at a time
to the compressed cache and score each next token (:func:`kvstate.lab.perplexity.continuation_nll`);
a row's ``score`` (and ``ppl``) is then ``exp(total NLL / scored tokens)`` over its items (lower is
better), not an accuracy.

kvpress presses run in their own environment (:mod:`kvstate.lab.semantic.baselines_kvpress`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache

from kvstate.lab.decode import greedy_decode
from kvstate.lab.perplexity import TextNLL, continuation_nll, pooled_perplexity
from kvstate.lab.scoring import METRIC_FUNCTIONS, extract_answer
from kvstate.lab.semantic.protocol import PPL, Item
from kvstate.semantic.attention import semantic_attention
from kvstate.semantic.cache import SemanticCache, SemanticConfig, surprisal
from kvstate.semantic.router import SemanticRouter
from kvstate.semantic.segment import SegmentConfig

IN_PROCESS = ("full", "sekv", "sentencekv", "quest")


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
    fast_bytes: int  # bytes held in the fast tier right after compression (all bytes for eviction methods)
    slow_bytes: int  # bytes held in the slow tier (CPU) right after compression
    decode_s: float  # wall time of the single-token decode steps
    decode_steps: int
    expanded: float | None  # SEKV: mean expanded fraction of span tokens over the question's forward calls
    nll: float | None = None  # ppl items: summed next-token NLL of the continuation (nats)
    tokens: int = 0  # ppl items: continuation tokens scored


def score_prediction(item: Item, q: int, prediction: str) -> float:
    return METRIC_FUNCTIONS[item.metric](extract_answer(prediction), item.answers[q])


def _answer(model: Any, cache: Any, question: list[int], start: int, max_new: int, eos: int,
            tokenizer: Any) -> tuple[str, float, int]:
    """(greedy answer to ``question`` fed after a cache of ``start`` tokens, decode seconds, decode steps)."""
    res = greedy_decode(model, cache, start, max_new, eos, input_ids=question)
    return tokenizer.decode(res.tokens, skip_special_tokens=True), res.decode_s, res.steps


def sentence_score(tokenizer: Any, ids: list[int]) -> np.ndarray:
    """SentenceKV-like anchor score: 1 at each sentence's first token, then a small recency ramp."""
    period = tokenizer.convert_tokens_to_ids(".")
    arr = np.asarray(ids)
    starts = np.zeros(len(arr))
    starts[1:] = (arr[:-1] == period).astype(float)
    return starts + 1e-3 * np.arange(len(arr)) / max(len(arr), 1)


@torch.no_grad()
def run_method(method: str, model: Any, tokenizer: Any, items: Sequence[Item], budget: float,
               router: SemanticRouter | None, segment: SegmentConfig,
               progress: Callable[[], None] | None = None, config: SemanticConfig | None = None) -> list[Outcome]:
    """Answer every question of ``items`` under one in-process method at one budget.

    ``config`` replaces SEKV's cache settings (e.g. ``zoom="all"`` at full rank: the exact oracle).
    """
    if method not in IN_PROCESS:
        raise ValueError(f"unknown in-process method {method!r}; choose from {IN_PROCESS}")
    outcomes: list[Outcome] = []
    cfg = config
    eos = tokenizer.eos_token_id
    for it in items:
        ctx = torch.tensor([it.context])
        tc = ctx.shape[1]
        if method == "full":
            cache: Any = DynamicCache(config=model.config)
            model(input_ids=ctx, position_ids=torch.arange(tc)[None], cache=cache, use_cache=True)
            fast = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers  # attention layers only
                       if getattr(layer, "keys", None) is not None)
            slow = 0
        else:
            from kvstate.lab.semantic.quest import QuestCache

            zoom = "learned" if method == "sekv" else "none"
            config = SemanticConfig(budget=budget, segment=segment, zoom=zoom, slow_tier=method == "sekv") \
                if method != "sekv" or cfg is None else cfg
            cache = QuestCache(model, router, config) if method == "quest" else SemanticCache(model, router, config)
            logits = model(input_ids=ctx, position_ids=torch.arange(tc)[None], cache=cache, use_cache=True).logits
            score = surprisal(logits, ctx) if method == "sekv" else torch.as_tensor(sentence_score(tokenizer, it.context))
            cache.compress(score)
            nb = cache.nbytes()
            fast, slow = nb["fast"], nb["slow"]
        if it.task == PPL:  # compress, then continue: no copy needed, one continuation per context
            if method == "full":
                got = continuation_nll(model, it.context + it.questions[0], tc, cache, stepwise=True)
                expanded = None
            else:
                with semantic_attention(model):
                    got = continuation_nll(model, it.context + it.questions[0], tc, cache, stepwise=True)
                expanded = cache.expanded_fraction() if method in ("sekv", "quest") else 0.0
            outcomes.append(Outcome(method, budget, it.task, it.length, it.index, 0, None,
                                    pooled_perplexity([got]), "", fast, slow, got.seconds, got.tokens, expanded,
                                    got.nll, got.tokens))
            if progress is not None:
                progress()
            continue
        for qi, (q, mx) in enumerate(zip(it.questions, it.max_new_tokens, strict=True)):
            work = copy.deepcopy(cache, memo={id(router): router, id(model.config): model.config}) \
                if method != "full" else copy.deepcopy(cache)
            if method == "full":
                pred, dt, steps = _answer(model, work, q, tc, mx, eos, tokenizer)
                expanded = None
            else:
                with semantic_attention(model):
                    pred, dt, steps = _answer(model, work, q, tc, mx, eos, tokenizer)
                expanded = work.expanded_fraction() if method in ("sekv", "quest") else 0.0
            outcomes.append(Outcome(method, budget, it.task, it.length, it.index, qi, it.depth,
                                    score_prediction(it, qi, pred), pred, fast, slow, dt, steps, expanded))
        if progress is not None:
            progress()
    return outcomes


def summarise(outcomes: Sequence[Outcome]) -> list[dict[str, Any]]:
    """One row per (method, budget, task, length): the issue's JSON fields plus n and expansion."""
    groups: dict[tuple[str, float, str, int], list[Outcome]] = {}
    for o in outcomes:
        groups.setdefault((o.method, o.budget, o.task, o.length), []).append(o)
    rows = []
    for (method, budget, task, length), g in groups.items():
        steps = sum(o.decode_steps for o in g)
        exp = [o.expanded for o in g if o.expanded is not None]
        ppl = pooled_perplexity(TextNLL(o.nll or 0.0, o.tokens, o.decode_s) for o in g) if task == PPL else None
        rows.append({"method": method, "budget": budget, "task": task, "length": length, "n": len(g),
                     "score": round(ppl, 4) if ppl is not None else round(float(np.mean([o.score for o in g])), 4),
                     "fast_bytes": int(np.mean([o.fast_bytes for o in g])),
                     "slow_bytes": int(np.mean([o.slow_bytes for o in g])),
                     "decode_ms_per_token": round(1000 * sum(o.decode_s for o in g) / max(steps, 1), 3),
                     "expanded_fraction": round(float(np.mean(exp)), 4) if exp else None,
                     **({"ppl": round(ppl, 4), "tokens": sum(o.tokens for o in g)} if ppl is not None else {})})
    return rows


def cells(outcomes: Sequence[Outcome]) -> list[dict[str, Any]]:
    """Per-question results with needle depth (for the length x depth heatmap)."""
    return [{"method": o.method, "budget": o.budget, "task": o.task, "length": o.length, "index": o.index,
             "question": o.question, "depth": o.depth, "score": o.score} for o in outcomes]
