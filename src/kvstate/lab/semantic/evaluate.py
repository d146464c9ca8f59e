"""The resolution benchmark on the lab's experiment loop: what ``kvstate semantic eval`` writes.

SEKV (*Semantic multi-resolution KV cache*, ``docs/techniques.md#resolution``) and every baseline are measured by
:mod:`kvstate.lab.semantic.bench` — item-major, so one prefill of an item serves every method and budget (the
loop's method-major order would prefill each item once per method) — and the measurements are then run through
:func:`kvstate.lab.experiment.run`, the one loop every axis's result goes through:

- each (method, budget) the run asks for is one method of the :class:`~kvstate.lab.experiment.Experiment`, named
  ``METHOD@BUDGET`` (:func:`loop_name`; that is also its name in the seed ledger, so a budget is part of what a
  method is);
- the question tasks x lengths are its cells with ``n`` items each; an item's value is its score (``niah_4q``:
  the mean of its four questions' scores, so every cell holds ``n`` values);
- the reference is the registry's ``reference`` method (the full cache) when it ran, so the loop's ``pooled``
  scores pool only the (task, length) cells the full cache solves on this run, the others in ``excluded_tasks``;
- the ledger and the output file are checked (:func:`plan` then :func:`kvstate.lab.experiment.preflight`) before
  any weight is read.

``ppl`` items (held-out perplexity) are not a rate in [0, 1]: their rows stay in the benchmark's own view
(``results``, a bootstrap over texts), measured under the same ledger and provenance; the loop's ``rows`` cover
the question tasks. A run that could not run (a budget below a method's minimum, kvpress unavailable) is in
``not_run`` and not among the loop's methods.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvstate.errors import KVStateError
from kvstate.lab import experiment as ex
from kvstate.lab.semantic import methods as registry
from kvstate.lab.semantic.protocol import PPL

EXPERIMENT = "sekv-eval"


def loop_name(method: str, budget: float) -> str:
    """The loop's (and the ledger's) name of one method at one budget, e.g. ``sekv@0.125``."""
    return f"{method}@{budget:g}"


def _reference(runs: Sequence[tuple[str, float]]) -> str | None:
    return next((loop_name(m, b) for m, b in runs if registry.get(m).role == "reference"), None)


def plan(runs: Sequence[tuple[str, float]], external: Mapping[str, Sequence[str]], budgets: Sequence[float],
         tasks: Sequence[str], lengths: Sequence[int], n: int, seed: int, models: Sequence[str | Path],
         settings: Mapping[str, Any], code: Sequence[str]) -> ex.Experiment:
    """The experiment a run asks for: the in-process ``runs`` and each external runner's names at each budget.

    Its provenance (:func:`kvstate.lab.experiment.recorder`, started before any work) is the run's, so the seed
    ledger names the methods as asked (``ExpectedAttentionPress@0.25``); :func:`measured` narrows it to what ran.
    """
    methods = [loop_name(m, b) for m, b in runs] + [loop_name(p, b) for names in external.values()
                                                   for p in names for b in budgets]
    return ex.Experiment(axis="resolution", name=EXPERIMENT, methods=tuple(methods), seeds=(seed,),
                         tasks=tuple(tasks), lengths=tuple(lengths), n=n, reference=_reference(runs),
                         code=tuple(code), models=tuple(str(m) for m in models), settings=dict(settings))


def item_values(outcomes: Sequence[Any]) -> dict[tuple[str, str, int], list[float]]:
    """Per (loop name, task, length): one value per item in index order (the mean over its questions)."""
    by: dict[tuple[str, str, int], dict[int, list[float]]] = {}
    for o in outcomes:
        if o.task == PPL:
            continue
        by.setdefault((loop_name(o.method, o.budget), o.task, o.length), {}).setdefault(o.index, []).append(o.score)
    return {k: [sum(v[i]) / len(v[i]) for i in sorted(v)] for k, v in by.items()}


def measured(planned: ex.Experiment, values: Mapping[tuple[str, str, int], Sequence[float]],
             runs: Sequence[tuple[str, float]]) -> ex.Experiment | None:
    """``planned`` narrowed to the question tasks and the methods that answered every cell, in plan order, an
    external runner's rows under the names its outcomes carry (kvpress: ``expected_attention_press@0.25``) after
    them (None: no question task, e.g. a perplexity-only run, or nothing ran). The reference stays the full
    cache when it ran, else the first method."""
    tasks = tuple(t for t in planned.tasks if t != PPL)
    if not tasks:
        return None
    names = list(planned.methods) + [m for m in dict.fromkeys(k[0] for k in values) if m not in planned.methods]

    def complete(m: str) -> bool:
        return all(len(values.get((m, t, L), ())) == planned.n for t in tasks for L in planned.lengths)

    ran = tuple(m for m in names if complete(m))
    missing = [m for m in names if not complete(m) and any((m, t, L) in values for t in tasks
                                                           for L in planned.lengths)]
    if missing:  # a method that answered some cells but not all: the bench broke its own contract
        raise KVStateError(f"semantic eval: {missing} answered only part of the {len(tasks) * len(planned.lengths)} "
                           f"cells of {planned.n} items each; the run cannot be pooled")
    if not ran:
        return None
    ref = _reference(runs)
    return dataclasses.replace(planned, tasks=tasks, methods=ran, reference=ref if ref in ran else None)


def run_loop(e: ex.Experiment, values: Mapping[tuple[str, str, int], Sequence[float]]) -> dict[str, Any]:
    """The loop's ``experiment, rows, pooled, decisions`` over the measured item values (nothing written: the
    caller appends the whole document with the run's provenance)."""

    def measure(cell: ex.Cell) -> ex.Measurement:
        return ex.Measurement([float(v) for v in values[(cell.method, cell.task, cell.length)]])

    doc = ex.run(e, measure)
    doc.pop("provenance")
    return doc


__all__ = ["EXPERIMENT", "item_values", "loop_name", "measured", "plan", "run_loop"]
