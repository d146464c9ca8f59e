"""One experiment loop: an experiment is data, one loop runs it and enforces the measurement protocol.

The protocol (``docs/lab.md``, :mod:`kvstate.lab.protocol`) as code rather than as a convention each axis
re-implements: an :class:`Experiment` names its axis, methods, tasks, lengths, items per cell, seeds and
repeats; :func:`run` calls one measuring function per cell and

- **refuses before any work** a result under ``models/`` on a dev seed or on a test seed the ledger already
  holds for a changed method (:func:`kvstate.lab.ledger.check_run`; one line naming the ledger entry);
- writes **one row schema** (:data:`ROW_KEYS`) with the run's provenance (:class:`kvstate.lab.provenance.Recorder`,
  which digests every module and driver script the run executed);
- pools a quality score over **only the tasks the reference solves** (``>= SOLVED_AT`` on this run), the
  excluded tasks listed beside it (:func:`kvstate.lab.protocol.solved_tasks`);
- decides every :class:`Target` by :func:`kvstate.lab.stats.decide` on an interval — paired against another
  method on the same items, Wilson for 0/1 rates — so a straddling interval is undecided, never met;
- runs timing cells as **interleaved repeats** (the method order rotates each repeat) and refuses a timing
  experiment with fewer than ``MIN_REPEATS`` repeats before it starts.

Two orders, one result schema: :func:`run` is method-major (one call per cell); :func:`run_items` is
**item-major** — one call per item returns every method's score on it, so one prefill of the item serves every
method — and journals each finished item beside the result file (:mod:`kvstate.lab.journal`), so an interrupted
run resumes where it stopped. Both end in the same rows, pooling and decisions.

Each decision carries what a report row needs (``seeds``, ``n``, ``tasks``, ``excluded_tasks``; timing:
``repeats`` and ``ci``): :func:`headline_fields` hands them to :func:`kvstate.lab.report.html.artifact_row`.
The statistics are :mod:`kvstate.lab.stats` (the papers are those its intervals come from: Wilson 1927,
Efron's percentile bootstrap); nothing here is a technique of its own.

Ignored: multiple-comparison corrections, and adaptive stopping (n is fixed before the run).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from kvstate.errors import KVStateError
from kvstate.lab import protocol, stats

AXES = ("position", "depth", "resolution", "across models", "reference")  # reference: the full-cache baselines
Kind = Literal["quality", "timing"]
Metric = Literal["score", "difference", "time", "ratio"]
ROW_KEYS = ("method", "task", "length", "seed", "n", "values", "value", "ci", "extra")
NO_TASK, NO_LENGTH = "-", 0  # an experiment without tasks / lengths has one of each


@dataclass(frozen=True)
class Cell:
    """One measurement: a method on a task at a length and seed; ``repeat`` counts interleaved repeats."""

    method: str
    task: str
    length: int
    seed: int
    repeat: int
    n: int  # items to score (quality) in this cell


@dataclass(frozen=True)
class Measurement:
    """What a measuring function returns for one cell.

    Quality: ``values`` holds one score in [0, 1] per item (``n`` of them, the same items for every method so
    methods pair). Timing: ``values`` holds one duration (seconds, or any positive cost) for this repeat.
    ``extra``: anything else worth keeping (JSON-serialisable; merged per row, last repeat wins).
    """

    values: Sequence[float]
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Target:
    """A pre-registered target, decided on an interval.

    ``metric``: ``score`` (the method's pooled rate), ``difference`` (method minus ``against`` on the same items,
    paired), ``time`` (median of the method's repeats), ``ratio`` (median of per-repeat method / ``against``,
    interleaved so each ratio pairs one repeat).
    """

    label: str  # what is promised, e.g. "SEKV within 2 pp of the full cache"
    method: str
    metric: Metric
    threshold: float
    higher_is_better: bool = True
    against: str | None = None  # the paired rival for difference / ratio


@dataclass(frozen=True)
class Experiment:
    """An experiment as data; :func:`run` runs it."""

    axis: str  # one of AXES
    name: str  # e.g. "sekv-eval"; the result's "experiment"
    methods: tuple[str, ...]  # registry names, measured in this order (rotated per repeat)
    seeds: tuple[int, ...]
    tasks: tuple[str, ...] = (NO_TASK,)
    lengths: tuple[int, ...] = (NO_LENGTH,)
    n: int = 1  # items per (task, length, seed) cell (quality); protocol.HEADLINE_N for a headline
    repeats: int = 1  # interleaved repeats per cell (timing: >= stats.MIN_REPEATS)
    kind: Kind = "quality"
    reference: str | None = None  # quality: whose scores decide the solved tasks (default: the first method)
    targets: tuple[Target, ...] = ()
    code: tuple[str, ...] = ()  # source the methods are (relative to src/kvstate), e.g. ("semantic", "lab/semantic")
    models: tuple[str, ...] = ()  # model / router / codec directories read
    settings: Mapping[str, Any] = field(default_factory=dict)  # hyperparameters (part of what a method is)

    def __post_init__(self) -> None:
        check_experiment(self)

    @property
    def ref(self) -> str:
        return self.reference or self.methods[0]


def check_experiment(e: Experiment) -> None:
    """Refuse an experiment the protocol cannot decide anything from, before any work (one line each)."""
    if e.axis not in AXES:
        raise KVStateError(f"experiment {e.name!r}: axis {e.axis!r} is unknown; choose one of {', '.join(AXES)}")
    if not e.methods or len(set(e.methods)) != len(e.methods):
        raise KVStateError(f"experiment {e.name!r}: methods {list(e.methods)} must be non-empty and distinct")
    if not e.seeds or not e.tasks or not e.lengths:
        raise KVStateError(f"experiment {e.name!r}: needs at least one seed, task and length")
    if e.kind not in ("quality", "timing"):
        raise KVStateError(f"experiment {e.name!r}: kind {e.kind!r}; choose quality or timing")
    if e.n < 1 or e.repeats < 1:
        raise KVStateError(f"experiment {e.name!r}: n ({e.n}) and repeats ({e.repeats}) must be >= 1")
    if e.kind == "timing" and e.repeats < stats.MIN_REPEATS:
        raise KVStateError(f"experiment {e.name!r}: {e.repeats} repeat(s); a timing experiment needs >= "
                           f"{stats.MIN_REPEATS} interleaved repeats with their spread — pass repeats="
                           f"{stats.MIN_REPEATS} or more")
    if e.reference is not None and e.reference not in e.methods:
        raise KVStateError(f"experiment {e.name!r}: reference {e.reference!r} is not one of its methods "
                           f"{list(e.methods)}")
    metrics = ("score", "difference") if e.kind == "quality" else ("time", "ratio")
    for t in e.targets:
        if t.metric not in metrics:
            raise KVStateError(f"target {t.label!r}: metric {t.metric!r} does not fit a {e.kind} experiment; "
                               f"choose one of {', '.join(metrics)}")
        named = [t.method] + ([t.against] if t.against is not None else [])
        unknown = [m for m in named if m not in e.methods]
        if unknown:
            raise KVStateError(f"target {t.label!r}: method(s) {unknown} not measured; measured: {list(e.methods)}")
        if (t.metric in ("difference", "ratio")) != (t.against is not None):
            raise KVStateError(f"target {t.label!r}: a {t.metric} target {'needs' if t.against is None else 'takes no'}"
                               " `against` method")


def cells(e: Experiment) -> list[Cell]:
    """Every cell in run order: seed, length, task, repeat, then the methods — rotated by one each repeat so
    no method always runs first (interleaved repeats)."""
    out = []
    k = len(e.methods)
    for seed in e.seeds:
        for length in e.lengths:
            for task in e.tasks:
                for r in range(e.repeats):
                    order = [e.methods[(i + r) % k] for i in range(k)]
                    out += [Cell(m, task, length, seed, r, e.n) for m in order]
    return out


def recorder(e: Experiment, command: str | None = None) -> Any:
    """The run's provenance recorder (methods, axis, repeats and kind recorded beside the settings)."""
    from kvstate.lab.provenance import Recorder

    return Recorder(code=e.code, models=list(e.models), n=e.n, seeds=list(e.seeds),
                    tasks=[t for t in e.tasks if t != NO_TASK], lengths=[x for x in e.lengths if x != NO_LENGTH],
                    command=command, settings={**dict(e.settings), "methods": list(e.methods), "axis": e.axis,
                                               "experiment": e.name, "kind": e.kind, "repeats": e.repeats})


def preflight(out: Path, provenance: Mapping[str, Any]) -> None:
    """Refuse now (before any work) a run the seed ledger would refuse when it is written under ``models/``."""
    from kvstate.lab import ledger

    root = ledger.results_root()
    p = Path(out).resolve()
    if p.is_relative_to(root.resolve()):
        ledger.check_run(p, provenance, ledger.read_ledger(root / ledger.LEDGER_NAME), root,
                         root / ledger.LEDGER_NAME)


def check_out(e: Experiment, out: Path | None, *, overwrite: bool = False) -> None:
    """Everything :func:`run` / :func:`run_items` refuse before any work — the output file and the seed ledger —
    for a caller to call before it loads any weights."""
    from kvstate.lab.cli_output import check_results_out

    if out is not None:
        check_results_out(out, overwrite=overwrite)
        preflight(out, recorder(e).finish())


def _key(task: str, length: int) -> str:
    return task if length == NO_LENGTH else f"{task}@{length}"


def _rows(e: Experiment, results: Mapping[Cell, Measurement]) -> list[dict[str, Any]]:
    by_cell: dict[tuple[str, str, int, int], list[tuple[int, Measurement]]] = {}
    for c, one in results.items():
        by_cell.setdefault((c.method, c.task, c.length, c.seed), []).append((c.repeat, one))
    rows = []
    for seed in e.seeds:
        for length in e.lengths:
            for task in e.tasks:
                for m in e.methods:
                    got = [g for _, g in sorted(by_cell.get((m, task, length, seed), []), key=lambda x: x[0])]
                    if e.kind == "quality":
                        values = [float(v) for g in got for v in g.values]
                        est = stats.rate(values, seed=seed) if values else None
                    else:
                        values = [float(g.values[0]) for g in got]
                        est = stats.timing(values, what=f"{m} {task} {length}")
                    extra: dict[str, Any] = {}
                    for g in got:
                        extra.update(g.extra)
                    rows.append({"method": m, "task": task, "length": length, "seed": seed, "n": len(values),
                                 "values": values, "value": None if est is None else est.value,
                                 "ci": None if est is None else est.ci, "extra": extra})
    return rows


def _scores(rows: Sequence[dict[str, Any]], method: str) -> dict[str, list[float]]:
    """A method's per-item scores per (task, length) cell, seeds concatenated in run order."""
    out: dict[str, list[float]] = {}
    for r in rows:
        if r["method"] == method:
            out.setdefault(_key(r["task"], r["length"]), []).extend(r["values"])
    return out


def _times(rows: Sequence[dict[str, Any]], method: str) -> list[float]:
    return [v for r in rows if r["method"] == method for v in r["values"]]


def pooled(e: Experiment, rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Quality: each method's rate over the cells the reference solves, the excluded cells beside."""
    split = protocol.solved_tasks(_scores(rows, e.ref))
    out: dict[str, Any] = {"reference": e.ref, "tasks": split.solved, "excluded_tasks": split.excluded,
                           "methods": {}}
    for m in e.methods:
        values = split.pool(_scores(rows, m)) if split.solved else []
        est = stats.rate(values) if values else None
        out["methods"][m] = {"value": None if est is None else est.value, "ci": None if est is None else est.ci,
                             "n": len(values)}
    return out


def decide_target(e: Experiment, t: Target, rows: Sequence[dict[str, Any]],
                  pool: Mapping[str, Any] | None) -> dict[str, Any]:
    """One target decided on its interval, with what a headline row carries."""
    base: dict[str, Any] = {"label": t.label, "method": t.method, "metric": t.metric, "against": t.against,
                            "threshold": t.threshold, "higher_is_better": t.higher_is_better,
                            "seeds": list(e.seeds)}
    if pool is not None:
        tasks, excluded = pool["tasks"], pool["excluded_tasks"]
        base.update(tasks=tasks, excluded_tasks=excluded)
        if not tasks:
            return {**base, "value": None, "ci": None, "n": 0, "status": "undecided",
                    "why": f"the reference ({e.ref}) solves no task at >= {protocol.SOLVED_AT}"}
        split = protocol.Pooled(tasks, excluded)
        a = split.pool(_scores(rows, t.method))
        if t.metric == "score":
            est = stats.rate(a, seed=e.seeds[0])
        else:
            est = stats.paired_difference(a, split.pool(_scores(rows, str(t.against))), seed=e.seeds[0])
    else:
        base.update(tasks=[x for x in e.tasks if x != NO_TASK], excluded_tasks={}, repeats=e.repeats)
        a = _times(rows, t.method)
        if t.metric == "ratio":
            b = _times(rows, str(t.against))
            a = [x / y for x, y in zip(a, b, strict=True)]
        est = stats.timing(a, what=t.label)
    status = stats.decide(est.lo, est.hi, t.threshold, higher_is_better=t.higher_is_better)
    return {**base, "value": est.value, "ci": est.ci, "n": est.n, "status": status}


def run(e: Experiment, measure: Callable[[Cell], Measurement], *, out: Path | None = None, overwrite: bool = False,
        command: str | None = None, progress: bool = False) -> dict[str, Any]:
    """Run every cell of ``e`` through ``measure``, pool, decide the targets; append to ``out`` with provenance.

    ``out`` under ``models/`` passes the seed ledger before the first cell runs (a dev seed or a used test seed
    for a changed method is refused with one line naming the ledger entry). Returns the result document
    (``experiment``, ``rows``, ``pooled``, ``decisions``) with ``provenance`` beside it.
    """
    from kvstate.lab.cli_output import write_results

    check_experiment(e)
    rec = recorder(e, command)
    check_out(e, out, overwrite=overwrite)
    from kvstate.lab.progress import progress_bar

    todo = cells(e)
    results: dict[Cell, Measurement] = {}
    with progress_bar(e.name, len(todo), enabled=progress, unit="cells") as bar:
        for c in todo:
            got = measure(c)
            _check_measurement(e, c, got)
            results[c] = got
            bar.advance()
    rows = _rows(e, results)
    pool = pooled(e, rows) if e.kind == "quality" else None
    decisions = [decide_target(e, t, rows, pool) for t in e.targets]
    result = {"experiment": {**asdict(e), "settings": dict(e.settings)}, "rows": rows, "pooled": pool,
              "decisions": decisions}
    prov = rec.finish()
    if out is not None:
        write_results(out, result, prov, overwrite=overwrite)
    return {**result, "provenance": prov}


@dataclass(frozen=True)
class Item:
    """One item of an item-major quality experiment: every method is scored on it from one prefill."""

    seed: int
    length: int
    task: str
    index: int

    @property
    def unit(self) -> str:
        """The item's name in the run's journal."""
        return f"{self.seed}/{self.length}/{self.task}/{self.index}"


@dataclass(frozen=True)
class ItemResult:
    """What an item-major measuring function returns: one score in [0, 1] per method of the experiment, and
    anything worth keeping about the item (its reply, depth, seconds; JSON values) in ``extra``."""

    scores: Mapping[str, float]
    extra: Mapping[str, Any] = field(default_factory=dict)


def items(e: Experiment) -> list[Item]:
    """Every item in run order: seed, length, item index, then the tasks (interleaved, so a run cut short
    has touched every task)."""
    return [Item(seed, length, task, i) for seed in e.seeds for length in e.lengths for i in range(e.n)
            for task in e.tasks]


def _check_item(e: Experiment, item: Item, got: Any) -> dict[str, Any]:
    if not isinstance(got, ItemResult):
        raise KVStateError(f"experiment {e.name!r}: the item function returned {type(got).__name__} for {item}; "
                           "return an ItemResult(scores={method: score, ...})")
    if set(got.scores) != set(e.methods):
        raise KVStateError(f"experiment {e.name!r}: item {item.unit} scored methods {sorted(got.scores)}; "
                           f"an item scores every method of the experiment: {list(e.methods)}")
    bad = {m: v for m, v in got.scores.items() if not 0.0 <= float(v) <= 1.0}
    if bad:
        raise KVStateError(f"experiment {e.name!r}: item {item.unit} scores {bad} are outside [0, 1]")
    return {"scores": {m: float(got.scores[m]) for m in e.methods}, "extra": dict(got.extra)}


def run_items(e: Experiment, measure_item: Callable[[Item], ItemResult], *, out: Path | None = None,
              overwrite: bool = False, command: str | None = None, progress: bool = False,
              say: Callable[[str], None] | None = None,
              appendix: Callable[[Any], Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """Item-major :func:`run` for a quality experiment: ``measure_item`` scores every method on one item.

    Each finished item is journaled beside ``out`` (a rerun of the same experiment, code and models resumes;
    another's journal is moved aside, never mixed in). The result is :func:`run`'s document plus ``items``
    (one record per item: its identity, every method's score and its ``extra``). ``appendix(journal)``, run after
    the items, returns measurements that are not rates (held-out perplexity): they go into the result under
    ``appendix``, journaled by the caller through :func:`kvstate.lab.journal.once` if it likes.
    """
    from kvstate.lab.cli_output import write_results
    from kvstate.lab.journal import open_journal
    from kvstate.lab.progress import progress_bar

    check_experiment(e)
    if e.kind != "quality":
        raise KVStateError(f"experiment {e.name!r}: run_items measures quality; time a {e.kind} experiment with run()")
    rec = recorder(e, command)
    check_out(e, out, overwrite=overwrite)
    journal = open_journal(out, {**asdict(e), "settings": dict(e.settings)}, e.code, e.models,
                           say or (lambda _m: None))
    todo = items(e)
    records: list[dict[str, Any]] = []
    with progress_bar(e.name, len(todo), enabled=progress, unit="items") as bar:
        for item in todo:
            got = journal.get(item.unit) if journal is not None else None
            if got is None:
                got = _check_item(e, item, measure_item(item))
                if journal is not None:
                    journal.put(item.unit, got)
            records.append({**asdict(item), **got})
            bar.advance()
    per_cell: dict[tuple[str, str, int, int], list[float]] = {}
    for r in records:
        for m, v in r["scores"].items():
            per_cell.setdefault((m, r["task"], r["length"], r["seed"]), []).append(float(v))
    results = {Cell(m, t, L, s, 0, e.n): Measurement(v) for (m, t, L, s), v in per_cell.items()}
    rows = _rows(e, results)
    pool = pooled(e, rows)
    decisions = [decide_target(e, t, rows, pool) for t in e.targets]
    result: dict[str, Any] = {"experiment": {**asdict(e), "settings": dict(e.settings)}, "rows": rows,
                              "pooled": pool, "decisions": decisions, "items": records}
    if appendix is not None:
        result["appendix"] = dict(appendix(journal))
    prov = rec.finish() if journal is None else journal.stamp(rec.finish())
    if out is not None:
        write_results(out, result, prov, overwrite=overwrite)
    if journal is not None:
        journal.close()
    return {**result, "provenance": prov}


def _check_measurement(e: Experiment, c: Cell, got: Measurement) -> None:
    if not isinstance(got, Measurement):
        raise KVStateError(f"experiment {e.name!r}: the measuring function returned {type(got).__name__} for {c}; "
                           "return a Measurement(values=[...])")
    want = c.n if e.kind == "quality" else 1
    what = "one score per item" if e.kind == "quality" else "one duration per repeat"
    if len(got.values) != want:
        raise KVStateError(f"experiment {e.name!r}: {c.method} on {c.task} returned {len(got.values)} value(s); "
                           f"a {e.kind} cell returns {want} ({what})")


def headline_fields(decision: Mapping[str, Any]) -> dict[str, Any]:
    """The fields a report headline row takes from a decision: status, ci, seeds, n, tasks, excluded tasks,
    and for a timing decision its repeats."""
    keys = ("status", "ci", "seeds", "n", "tasks", "excluded_tasks", "repeats")
    out = {k: decision[k] for k in keys if k in decision}
    if out.get("ci") is not None:
        out["ci"] = (float(out["ci"][0]), float(out["ci"][1]))
    return out


def decisions_of(run_doc: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """A result run's decisions by label (for a report section reading a committed experiment file)."""
    return {str(d["label"]): dict(d) for d in run_doc.get("decisions") or []}


__all__ = ["AXES", "ROW_KEYS", "Cell", "Experiment", "Item", "ItemResult", "Measurement", "Target", "cells",
           "check_experiment", "check_out", "decide_target", "decisions_of", "headline_fields", "items", "pooled",
           "preflight", "recorder", "run", "run_items"]
