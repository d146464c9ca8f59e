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


def _method(model: str, keep: float, pattern: str) -> str:
    """The experiment loop's (and the seed ledger's) name for one model's pattern at one kept fraction."""
    return f"{model}:{keep:g}/{pattern}"


def evaluate_sharing(model_dir: str | Path, keeps: Sequence[float], kind: str = "keep", *, n: int = 10, seed: int = 0,
                     progress: bool = False, model: Any = None, tokenizer: Any = None,
                     tasks: Sequence[str] = SCORE_TASKS, lengths: Sequence[int] = SCORE_LENGTHS,
                     ppl_length: int = PPL_LENGTH, ppl_texts: int = protocol.PPL_TEXTS, post_hoc: bool = False,
                     depth: dict[str, Any] | None = None, out: Path | None = None, overwrite: bool = False,
                     code: Sequence[str] = ()) -> dict[str, Any]:
    """Run the depth evaluation through the lab's experiment loop (:func:`kvstate.lab.experiment.run`).

    Every (kept fraction, pattern) is a method of one :class:`~kvstate.lab.experiment.Experiment` over
    ``tasks`` x ``lengths`` with ``n`` items per cell; the full cache (the identity pattern; added when keep 1 is
    not asked for) is its reference, so scores pool only the (task, length) cells it solves, the others listed
    in ``excluded_tasks``. ``out`` is checked against the seed ledger before any item runs and the run appended
    with provenance (``code``: the source it depends on).

    The document holds the loop's ``experiment, rows, pooled, decisions`` and the depth view of the same rows:
    ``model, n, seed, tasks, lengths, ppl_texts, ppl_length`` and ``results``, one row per keep: ``keep, pattern,
    ppl, ppl_ci, score, score_ci, kv_bytes_per_token, peak_bytes, decode_tok_s, items`` (per-item exact match over
    the solved cells, in ``(task, length, index)`` order), ``tasks, excluded_tasks`` for the headline pattern, and
    ``family, family_patterns, mean_score, worst_score, worst_score_ci, worst_pattern`` over the declared family at
    that keep (:func:`family_plan`). A score is ``None`` when the full cache solves no cell. Every pattern is built
    (and every bad fraction or out-of-family pattern rejected) before the model runs. ``model`` / ``tokenizer``
    skip loading ``model_dir``; ``depth`` (the run's depth entry) is read from ``model_dir``'s training state when
    not given.
    """
    from kvstate.depth.attention import layer_specs
    from kvstate.depth.patterns import SharingPattern, format_pattern
    from kvstate.depth.sharing import apply_sharing
    from kvstate.lab import experiment as ex
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
    identity = SharingPattern(tuple(range(len(specs))))
    name = Path(model_dir).name
    patterns: dict[str, Any] = {}  # method name -> pattern, in run order (the reference first)
    if not any(abs(k - 1.0) < 1e-12 and p == identity for k, p, _, _ in plans):
        patterns[_method(name, 1.0, format_pattern(identity))] = identity
    for keep, _, family, _ in plans:
        for pat in family:
            patterns.setdefault(_method(name, keep, format_pattern(pat)), pat)
    reference = next(m for m, pat in patterns.items() if pat == identity and m.startswith(f"{name}:1/"))
    e = ex.Experiment(axis="depth", name="depth-eval", methods=tuple(patterns), seeds=(seed,), tasks=tuple(tasks),
                      lengths=tuple(lengths), n=n, reference=reference, code=tuple(code), models=(str(model_dir),),
                      settings={"keep": list(keeps), "pattern_kind": kind, "post_hoc": post_hoc})

    texts = [tokenizer(x.prompt)["input_ids"] for x in generate("text", ppl_length, ppl_texts, seed, tokenizer)]
    nlls: dict[float, list[Any]] = {}

    def measure(cell: Any) -> Any:
        pattern = patterns[cell.method]
        with apply_sharing(model, pattern):
            res = _score(model, tokenizer, pattern, [cell.task], [cell.length], cell.n, cell.seed, False)
        got = list(res.examples)
        return ex.Measurement([float(x.score) for x in got], {
            "bytes_per_token": [x.cache_bytes / x.n_tokens for x in got],
            "peak_bytes": max(x.cache_bytes for x in got), "decode_s": sum(x.decode_s for x in got),
            "new_tokens": sum(x.new_tokens for x in got)})

    def summarize(rows: Sequence[dict[str, Any]], pool: Any) -> dict[str, Any]:
        solved = list(pool["tasks"])
        order = [ex._key(t, length) for t in tasks for length in lengths]  # (task, length, index) order
        cells_ = [c for c in order if c in solved]

        def scored(name: str) -> tuple[Any, list[float], list[float]]:
            by = {ex._key(r["task"], r["length"]): r["values"] for r in rows if r["method"] == name}
            items = [float(v) for c in cells_ for v in by[c]]
            return (stats.rate(items, seed=seed) if items else None), items, [float(v) for c in order for v in by[c]]

        out_rows = []
        for keep, pattern, family, how in plans:
            head = _method(name, keep, format_pattern(pattern))
            score, items, all_items = scored(head)
            fam = {format_pattern(p): scored(_method(name, keep, format_pattern(p))) for p in family}
            known = {k: v for k, v in fam.items() if v[0] is not None}
            worst = min(known, key=lambda k: (known[k][0].value, k)) if known else format_pattern(pattern)
            mine = [r for r in rows if r["method"] == head]
            per_token = [b for r in mine for b in r["extra"]["bytes_per_token"]]
            decode_s = sum(r["extra"]["decode_s"] for r in mine)
            nll = nlls[keep]
            ppl = stats.perplexity([t.nll for t in nll], [t.tokens for t in nll], seed=seed)

            def r4(est: Any) -> Any:
                return None if est is None else round(est.value, 4)

            def ci4(est: Any) -> Any:
                return None if est is None else [round(est.lo, 4), round(est.hi, 4)]

            out_rows.append({
                "keep": keep, "pattern": format_pattern(pattern),
                "ppl": round(ppl.value, 4), "ppl_ci": [round(ppl.lo, 4), round(ppl.hi, 4)],
                "score": r4(score), "score_ci": ci4(score),
                "kv_bytes_per_token": round(sum(per_token) / len(per_token), 2),
                "peak_bytes": max(r["extra"]["peak_bytes"] for r in mine),
                "decode_tok_s": round(sum(r["extra"]["new_tokens"] for r in mine) / decode_s, 1) if decode_s else 0.0,
                "items": items, "tasks": solved, "excluded_tasks": dict(pool["excluded_tasks"]),
                "cells": order, "all_items": all_items,  # every cell, so two models pair on the cells both solve
                "text_nll": [[round(t.nll, 5), t.tokens] for t in nll], "family": how,
                "family_patterns": {k: {"score": r4(est), "score_ci": ci4(est), "items": its, "all_items": every}
                                    for k, (est, its, every) in fam.items()},
                "mean_score": round(sum(v[0].value for v in known.values()) / len(known), 4) if known else None,
                "worst_score": r4(known[worst][0]) if known else None,
                "worst_score_ci": ci4(known[worst][0]) if known else None, "worst_pattern": worst})
        return {"model": str(model_dir), "n": n, "seed": seed, "tasks": list(tasks), "lengths": list(lengths),
                "ppl_texts": ppl_texts, "ppl_length": ppl_length, "results": out_rows}

    from kvstate.lab.cli_output import check_results_out, write_results

    if out is not None:  # the ledger and the output file before any work
        check_results_out(out, overwrite=overwrite)
        ex.preflight(out, ex.recorder(e).finish())
    for keep, pattern, _, _ in plans:  # perplexity of each keep's headline pattern (full forward, same texts)
        with apply_sharing(model, pattern):
            nlls[keep] = [continuation_nll(model, ids) for ids in texts]
    doc = ex.run(e, measure, progress=progress)  # the loop's rows, pooled scores and provenance; nothing written
    prov = doc.pop("provenance")
    doc.update(summarize(doc["rows"], doc["pooled"]))  # the depth view of the same rows beside them
    if out is not None:
        write_results(out, doc, prov, overwrite=overwrite)
    return {**doc, "provenance": prov}


__all__ = ["SCORE_LENGTHS", "SCORE_TASKS", "evaluate_sharing", "family_plan"]
