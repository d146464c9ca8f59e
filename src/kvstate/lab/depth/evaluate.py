"""Quality against KV memory under cross-layer sharing: the measurement behind ``kvstate depth eval``.

For each kept fraction a pattern of the chosen family (:func:`kvstate.depth.patterns.for_keep`) is
applied (:func:`kvstate.depth.sharing.apply_sharing`) and the model is scored under the lab's protocol
(``docs/lab.md``): ``score`` = mean exact match over the needle tasks the full cache solves
(``niah_single``, ``niah_multikey`` at 1K and 2K tokens; greedy decoding through the sharing cache),
with a 95% interval; ``ppl`` = perplexity on ``ppl_texts`` held-out texts (full forward under the same
pattern) with a bootstrap interval over texts; ``kv_bytes_per_token`` = bytes of the cache tensors after
prefill divided by the prompt tokens and ``peak_bytes`` = the largest cache held on any item (measured
from tensors, not computed); ``decode_tok_s`` = greedy decoding tokens per second. Per-item scores are
kept (``items``), and per-text NLL sums with their token counts (``text_nll``), so two models or two keeps
can be compared *paired* on the same items and texts. Used for Random
Cross-Layer Attention ("Stochastic KV Routing") and its controls.

A model trained with routing is deployed under *any* pattern of the family its training declares
(:func:`kvstate.depth.patterns.declared_family`; a fixed-pattern specialist declares its one pattern), so each
kept fraction also scores every pattern of that family (``family_patterns``: score, interval and items per
pattern) and reports ``mean_score``, ``worst_score`` (with ``worst_score_ci``) and ``worst_pattern``; ``ppl``,
bytes and speed are the headline pattern's (the family's :func:`~kvstate.depth.patterns.for_keep` pattern). A
headline pattern outside the declared family is refused with the layer it breaks
(:func:`kvstate.depth.patterns.check_in_family`) unless ``post_hoc`` (sharing applied to a model not trained for
it, e.g. the base model or the no-routing control: that pattern alone is scored). A model without a depth
entry (a ``kvstate train`` output) declares no family: its headline pattern alone is scored.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvstate.lab import protocol, stats

SCORE_TASKS = ("niah_single", "niah_multikey")  # the tasks the full cache solves at these lengths
SCORE_LENGTHS = (1024, 2048)
PPL_LENGTH = 1024


def family_plan(depth: dict[str, Any] | None, layers: Sequence[Any], keep: float, kind: str = "keep", *,
                post_hoc: bool = False) -> tuple[Any, list[Any], str]:
    """``(headline pattern, patterns to score (headline first), how)`` at one kept fraction for a run's ``depth``
    entry; ``how`` is ``declared`` / ``fixed`` (the run's family), ``undeclared`` (no depth entry) or ``post hoc``
    (the headline pattern is outside the family and ``post_hoc`` allows it). Raises :class:`PatternError` naming the
    layer a headline pattern breaks, or the keep the family has no pattern for."""
    from kvstate.depth.patterns import PatternError, check_in_family, for_keep, format_pattern, parse_pattern
    from kvstate.lab.depth.pilot import run_family

    headline = for_keep(layers, kind, keep)
    if depth is None:
        return headline, [headline], "undeclared"
    family, how = run_family(depth, layers, keep)
    if headline in family:
        return headline, [headline, *(p for p in family if p != headline)], how
    if post_hoc:
        return headline, [headline], "post hoc"
    if how == "fixed":
        fixed = parse_pattern(depth["pattern"])
        layer = next(i for i, (a, b) in enumerate(zip(headline.sources, fixed.sources, strict=True)) if a != b)
        raise PatternError(f"pattern {format_pattern(headline)!r} (keep {keep:g}): layer {layer} reads layer "
                           f"{headline.sources[layer]} but the model was trained on the fixed pattern "
                           f"{format_pattern(fixed)!r} only (layer {layer} reads {fixed.sources[layer]}); deploy "
                           f"{format_pattern(fixed)!r}, or pass --post-hoc to measure sharing it was not trained for")
    ps = depth.get("p_layer") or [float(depth["p"])] * len(layers)
    try:
        check_in_family(headline, layers, ps)
    except PatternError as err:
        raise PatternError(f"{err}, or pass --post-hoc to measure sharing it was not trained for") from None
    raise PatternError(f"keep {keep:g}: the {kind} pattern {format_pattern(headline)!r} is outside the declared family "
                       f"(p_layer {ps}); pass --post-hoc to measure it, or a keep the family covers")


def _score(model: Any, tokenizer: Any, pattern: Any, tasks: Sequence[str], lengths: Sequence[int], n: int, seed: int,
           progress: bool) -> Any:
    from kvstate.depth.sharing import sharing_cache
    from kvstate.lab.harness import run_tasks

    return run_tasks(model, tokenizer, list(tasks), list(lengths), n, seed,
                     cache_factory=lambda m, pat=pattern: sharing_cache(m.config, pat), progress=progress)


def evaluate_sharing(model_dir: str | Path, keeps: Sequence[float], kind: str = "keep", *, n: int = 10, seed: int = 0,
                     progress: bool = False, model: Any = None, tokenizer: Any = None,
                     tasks: Sequence[str] = SCORE_TASKS, lengths: Sequence[int] = SCORE_LENGTHS,
                     ppl_length: int = PPL_LENGTH, ppl_texts: int = protocol.PPL_TEXTS, post_hoc: bool = False,
                     depth: dict[str, Any] | None = None) -> dict[str, Any]:
    """``{"model", "n", "seed", "tasks", "lengths", "ppl_texts", "results": [row per keep]}``.

    A row: ``keep, pattern, ppl, ppl_ci, score, score_ci, kv_bytes_per_token, peak_bytes, decode_tok_s,
    items`` (per-item exact match, in ``(task, length, index)`` order) for the headline pattern, and ``family,
    family_patterns, mean_score, worst_score, worst_score_ci, worst_pattern`` over the declared family at that keep
    (:func:`family_plan`). Every pattern is built (and every bad fraction or out-of-family pattern rejected) before
    the model runs. ``model`` / ``tokenizer`` skip loading ``model_dir``; ``depth`` (the run's depth entry) is read
    from ``model_dir``'s training state when not given.
    """
    from kvstate.depth.attention import layer_specs
    from kvstate.depth.patterns import format_pattern
    from kvstate.depth.sharing import apply_sharing
    from kvstate.lab.harness import load_reference
    from kvstate.lab.perplexity import continuation_nll
    from kvstate.lab.training.io import STATE_FILE, read_state
    from kvstate.lab.workloads.tasks import generate

    if depth is None and (Path(model_dir) / STATE_FILE).is_file():
        depth = read_state(Path(model_dir) / STATE_FILE).get("depth")
    if model is None:
        model, tokenizer = load_reference(model_dir)
    specs = layer_specs(model.config)
    plans = [(k, *family_plan(depth, specs, k, kind, post_hoc=post_hoc)) for k in keeps]
    texts = [tokenizer(ex.prompt)["input_ids"] for ex in generate("text", ppl_length, ppl_texts, seed, tokenizer)]
    rows = []
    for keep, pattern, family, how in plans:
        with apply_sharing(model, pattern):
            res = _score(model, tokenizer, pattern, tasks, lengths, n, seed, progress)
            nll = [continuation_nll(model, ids) for ids in texts]
        items = [float(e.score) for e in res.examples]
        score = stats.rate(items, seed=seed)
        scored = {format_pattern(pattern): (score, items)}
        for other in family[1:]:
            with apply_sharing(model, other):
                more = [float(e.score) for e in _score(model, tokenizer, other, tasks, lengths, n, seed, progress).examples]
            scored[format_pattern(other)] = (stats.rate(more, seed=seed), more)
        worst = min(scored, key=lambda k: (scored[k][0].value, k))
        ppl = stats.perplexity([t.nll for t in nll], [t.tokens for t in nll], seed=seed)
        per_token = [e.cache_bytes / e.n_tokens for e in res.examples]
        decode_s = sum(e.decode_s for e in res.examples)
        rows.append({"keep": keep, "pattern": format_pattern(pattern),
                     "ppl": round(ppl.value, 4), "ppl_ci": [round(ppl.lo, 4), round(ppl.hi, 4)],
                     "score": round(score.value, 4), "score_ci": [round(score.lo, 4), round(score.hi, 4)],
                     "kv_bytes_per_token": round(sum(per_token) / len(per_token), 2),
                     "peak_bytes": max(e.cache_bytes for e in res.examples),
                     "decode_tok_s": round(sum(e.new_tokens for e in res.examples) / decode_s, 1) if decode_s else 0.0,
                     "items": items, "text_nll": [[round(t.nll, 5), t.tokens] for t in nll],
                     "family": how,
                     "family_patterns": {k: {"score": round(est.value, 4), "score_ci": [round(est.lo, 4), round(est.hi, 4)],
                                             "items": its} for k, (est, its) in scored.items()},
                     "mean_score": round(sum(est.value for est, _ in scored.values()) / len(scored), 4),
                     "worst_score": round(scored[worst][0].value, 4),
                     "worst_score_ci": [round(scored[worst][0].lo, 4), round(scored[worst][0].hi, 4)],
                     "worst_pattern": worst})
    return {"model": str(model_dir), "n": n, "seed": seed, "tasks": list(tasks), "lengths": list(lengths),
            "ppl_texts": ppl_texts, "ppl_length": ppl_length, "results": rows}


__all__ = ["SCORE_LENGTHS", "SCORE_TASKS", "evaluate_sharing", "family_plan"]
