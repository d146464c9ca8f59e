"""The evaluation harness: run a task set under a *cache policy* and score it.

For each ``(task, length)`` it generates ``n`` held-out examples (:func:`kvstate.lab.workloads.tasks.generate`),
prefills the prompt in one forward call into a fresh cache from the policy's factory, greedily decodes
the answer token by token (:func:`kvstate.lab.decode.greedy_decode`, batch size 1), and scores it with RULER's
metric (:func:`kvstate.lab.scoring.score`). Every example records its score, the bytes held by the
cache after prefill (the policy's memory), and prefill / decode wall time. Needle tasks spread their
examples' depths evenly over [0, 1] by default so the depth x length breakdown (:meth:`EvalResult.depth_grid`) covers
every depth. The default policy is the full cache, ``DynamicCache(config=model.config)``.

A cache policy is any callable ``model -> Cache``: technique issues pass a factory that builds their
own ``Cache`` subclass (compressed, shared, quantised, ...). Ignored: batching, sampling, and models
that need attention masks with padding (there is none at batch size 1).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache

from kvstate.errors import KVStateError
from kvstate.lab.decode import DecodeResult, forward_at, greedy_decode
from kvstate.lab.perplexity import continuation_nll, pooled_perplexity
from kvstate.lab.scoring import score
from kvstate.lab.workloads.tasks import DEPTH_TASKS, TASKS, Example, generate, min_length
from kvstate.models.accounting import cache_nbytes
from kvstate.models.loading import (
    MissingTokenizerError as MissingTokenizerError,  # re-export: one loader, in models
)

CacheFactory = Callable[[Any], Any]  # model -> a fresh transformers Cache for one example
SCORED_TASKS = tuple(t for t in TASKS if t != "text")  # tasks with an answer to score
EVEN = "even"  # depths of a needle task's n examples spread evenly over [0, 1]: i / (n - 1)
MAX_LENGTH = 2**20  # longest context evaluated when a model states no position limit (building examples is O(length))
MAX_EXAMPLES = 100_000  # examples per (task, length): more are built up front and would stall for hours
DECODE_ROOM = 32  # positions kept free for the answer when checking a length against the position limit


class UnknownTaskError(KVStateError):
    """A task name that the harness does not know."""


class LengthTooShortError(KVStateError):
    """A context length shorter than a task's fixed parts."""


class LengthTooLongError(KVStateError):
    """A context length beyond the model's position limit (or beyond any sensible evaluation)."""


@dataclass(frozen=True)
class ExampleResult:
    task: str
    length: int  # requested tokens of context + question
    index: int  # example index within (task, length, seed)
    depth: float | None  # needle / fact depth in [0, 1]; None for tasks without one
    n_tokens: int  # prompt tokens fed to the model (with <bos>)
    prediction: str  # decoded greedy continuation (up to <eos> or max_new_tokens)
    score: float  # RULER metric of the example, in [0, 1]
    cache_bytes: int  # bytes of every tensor in the cache right after prefill
    prefill_s: float  # wall time of the prefill forward call
    decode_s: float  # wall time of the greedy decoding steps
    new_tokens: int  # tokens generated


@dataclass(frozen=True)
class TaskScore:
    task: str
    length: int
    n: int  # examples scored
    score: float  # mean example score, in [0, 1]
    cache_bytes: float  # mean bytes after prefill
    prefill_s: float  # mean prefill seconds
    decode_s: float  # mean decode seconds


@dataclass(frozen=True)
class DepthGrid:
    """Mean score per (needle depth bin, length): the heatmap of needle-in-a-haystack results."""

    depths: list[float]  # bin centres, ascending
    lengths: list[int]  # ascending
    scores: list[list[float | None]]  # scores[i][j]: depth bin i, length j; None where no example fell
    counts: list[list[int]]  # examples per cell


@dataclass
class EvalResult:
    examples: list[ExampleResult] = field(default_factory=list)  # in (task, length, index) order

    def scores(self) -> list[TaskScore]:
        """One row per (task, length), in the order they were run."""
        groups: dict[tuple[str, int], list[ExampleResult]] = {}
        for ex in self.examples:
            groups.setdefault((ex.task, ex.length), []).append(ex)
        return [TaskScore(task, length, len(g), sum(e.score for e in g) / len(g),
                          sum(e.cache_bytes for e in g) / len(g), sum(e.prefill_s for e in g) / len(g),
                          sum(e.decode_s for e in g) / len(g)) for (task, length), g in groups.items()]

    def score(self, task: str, length: int) -> float:
        """Mean score of one (task, length) cell."""
        for row in self.scores():
            if (row.task, row.length) == (task, length):
                return row.score
        raise KeyError(f"no results for task {task!r} at length {length}")

    def depth_grid(self, task: str | None = None, bins: int = 5) -> DepthGrid:
        """Scores of the examples with a depth (optionally one ``task``) binned into ``bins`` depth bins."""
        if bins < 1:
            raise ValueError(f"depth_grid: bins={bins} must be >= 1")
        rows = [e for e in self.examples if e.depth is not None and (task is None or e.task == task)]
        lengths = sorted({e.length for e in rows})
        sums = [[0.0] * len(lengths) for _ in range(bins)]
        counts = [[0] * len(lengths) for _ in range(bins)]
        for e in rows:
            i, j = min(bins - 1, int(e.depth * bins)), lengths.index(e.length)  # type: ignore[operator]
            sums[i][j] += e.score
            counts[i][j] += 1
        scores = [[s / c if c else None for s, c in zip(sr, cr, strict=True)] for sr, cr in zip(sums, counts, strict=True)]
        return DepthGrid([(i + 0.5) / bins for i in range(bins)], lengths, scores, counts)

    def as_json(self, model: str, detail: bool = False) -> dict[str, Any]:
        """``{"model": ..., "results": [{"task", "length", "n", "score"}, ...]}`` (+ bytes and timing with detail)."""
        results = []
        for r in self.scores():
            row: dict[str, Any] = {"task": r.task, "length": r.length, "n": r.n, "score": round(r.score, 4)}
            if detail:
                row.update(cache_bytes=round(r.cache_bytes), prefill_s=round(r.prefill_s, 4),
                           decode_s=round(r.decode_s, 4))
            results.append(row)
        return {"model": model, "results": results}


def check_tasks(tasks: Sequence[str], lengths: Sequence[int]) -> None:
    """Raise a :class:`KVStateError` naming the valid choices for an unknown task or a too-short length."""
    if len(tasks) == 0:
        raise UnknownTaskError(f"no task given; choose from {', '.join(SCORED_TASKS)}")
    for kind, values in (("task", tasks), ("length", lengths)):
        dup = sorted({str(v) for v in values if list(values).count(v) > 1})
        if dup:
            raise KVStateError(f"{kind} {', '.join(dup)} given more than once; list each {kind} once "
                               "(raise --n for more examples)")
    for task in tasks:
        if task not in SCORED_TASKS:
            hint = " ('text' has no answer; measure it with perplexity())" if task == "text" else ""
            raise UnknownTaskError(f"unknown task {task!r}{hint}; choose from {', '.join(SCORED_TASKS)}")
    if len(lengths) == 0:
        raise LengthTooShortError("no length given; pass context lengths in tokens, e.g. 512,1024")
    for length in lengths:
        if not isinstance(length, int) or isinstance(length, bool) or length < 1:
            raise LengthTooShortError(f"length {length!r} must be a positive int (tokens of context + question)")
        if length > MAX_LENGTH:
            raise LengthTooLongError(f"length {length:,} is beyond {MAX_LENGTH:,} tokens, longer than any model here "
                                     "handles; pass a shorter --length")
        for task in tasks:
            need = min_length(task)
            if length < need:
                raise LengthTooShortError(f"length {length} is too short for task {task!r}, which needs at least "
                                          f"{need} tokens; pass --length >= {need}")


def check_lengths_fit(config: Any, lengths: Sequence[int], max_new_tokens: int | None = None) -> None:
    """Raise :class:`LengthTooLongError` for a length (+ room for the answer) beyond ``max_position_embeddings``."""
    from kvstate.models.families import text_config

    limit = getattr(text_config(config), "max_position_embeddings", None)
    if not isinstance(limit, int):
        return
    room = 1 + (max_new_tokens or DECODE_ROOM)  # <bos> and the answer
    for length in lengths:
        if length + room > limit:
            raise LengthTooLongError(f"length {length:,} + {room} tokens for <bos> and the answer exceeds the model's "
                                     f"max_position_embeddings={limit:,}; pass --length <= {limit - room:,}")


def default_cache(model: Any) -> Any:
    """The full-cache policy: a fresh ``DynamicCache`` with one layer object per decoder layer."""
    return DynamicCache(config=model.config)


@torch.inference_mode()
def greedy_answer(model: Any, tokenizer: Any, prompt: str, cache: Any,
                  max_new_tokens: int) -> tuple[str, int, float, DecodeResult, int]:
    """(decoded continuation, prompt tokens, prefill s, the decode, cache bytes after prefill) at batch 1."""
    ids = tokenizer(prompt)["input_ids"]  # with <bos>
    t0 = time.perf_counter()
    logits = forward_at(model, cache, ids, 0)[-1]  # (V,)
    prefill_s = time.perf_counter() - t0
    nbytes = cache_nbytes(cache)
    res = greedy_decode(model, cache, len(ids), max_new_tokens, tokenizer.eos_token_id, logits=logits)
    return tokenizer.decode(res.tokens, skip_special_tokens=True), len(ids), prefill_s, res, nbytes


def run_tasks(model: Any, tokenizer: Any, tasks: Sequence[str], lengths: Sequence[int], n: int, seed: int,
              cache_factory: CacheFactory | None = None, max_new_tokens: int | None = None,
              depths: Sequence[float] | str | None = EVEN, progress: bool = False) -> EvalResult:
    """Score ``model`` on ``n`` examples of every ``(task, length)`` under a cache policy.

    ``cache_factory(model)`` gives a fresh cache per example (default: full ``DynamicCache``).
    ``max_new_tokens`` caps decoding (default: the gold target's tokens + 8 per example, enough for any
    correct answer and its end marker). ``depths`` of needle tasks: ``"even"`` spreads the ``n``
    examples over [0, 1], a list is cycled over them, ``None`` draws one uniform depth per example.
    Deterministic in ``seed``.
    """
    from kvstate.lab.progress import progress_bar

    check_tasks(tasks, lengths)
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_EXAMPLES:
        raise KVStateError(f"n={n!r} must be an int in 1..{MAX_EXAMPLES:,} (examples per task and length)")
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise KVStateError(f"seed={seed!r} must be an int >= 0")
    check_lengths_fit(model.config, lengths, max_new_tokens)
    if max_new_tokens is not None and max_new_tokens < 1:
        raise KVStateError(f"max_new_tokens={max_new_tokens} must be >= 1 (or None for the target length + 8)")
    if isinstance(depths, str) and depths != EVEN:
        raise KVStateError(f"depths={depths!r} must be {EVEN!r}, a list of values in [0, 1], or None")
    even = [i / (n - 1) if n > 1 else 0.5 for i in range(n)]
    needle_depths = even if depths == EVEN else depths
    factory = cache_factory or default_cache
    was_training = model.training
    model.eval()
    result = EvalResult()
    bar = progress_bar("eval", len(tasks) * len(lengths) * n, enabled=progress, unit="ex")
    try:
        for task in tasks:
            for length in lengths:
                examples: list[Example] = generate(task, length, n, seed, tokenizer,
                                                   depths=needle_depths if task in DEPTH_TASKS else None)
                for i, ex in enumerate(examples):
                    budget = max_new_tokens or len(tokenizer(ex.target, add_special_tokens=False)["input_ids"]) + 8
                    pred, t, pre_s, dec, nbytes = greedy_answer(model, tokenizer, ex.prompt, factory(model), budget)
                    result.examples.append(ExampleResult(task, length, i, ex.depth, t, pred, score(ex, pred), nbytes,
                                                         pre_s, dec.decode_s, len(dec.tokens)))
                    bar.advance()
    finally:
        bar.close()
        model.train(was_training)
    return result


@torch.inference_mode()
def perplexity(model: Any, tokenizer: Any, length: int, n: int, seed: int) -> float:
    """Perplexity of ``model`` on ``n`` held-out ``text`` examples of ``length`` tokens (full forward)."""
    return pooled_perplexity(continuation_nll(model, tokenizer(ex.prompt)["input_ids"])
                             for ex in generate("text", length, n, seed, tokenizer))


def load_reference(model_dir: str | Path, dtype: torch.dtype | None = None) -> tuple[Any, Any]:
    """(model, tokenizer) of a local model directory; raises if it holds no tokenizer."""
    from kvstate.models.loading import load_model, load_tokenizer

    p = Path(model_dir)
    model = load_model(p, dtype)
    tokenizer = load_tokenizer(p)
    return model, tokenizer
