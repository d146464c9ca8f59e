"""SEKV's query-agnostic retention at 8:1 of bf16 memory and reads on the real model (issue 48's 8:1 target).

The 16:1 runs (:mod:`kvstate.lab.semantic.realmodel16`) chose SEKV's retention design: spans kept by context
reconstruction after KVzip (arXiv 2505.23416; :mod:`kvstate.semantic.retention`) and held as 4-bit codes
(``sekv_zip``). Here the same design holds 0.105 of the bf16 context K/V — it reads what it keeps, so with the
question and the answer its peak read stays within 1/8 — against issue 48's 8:1 targets (:func:`kvstate.lab.semantic.realmodel.targets`'s wording): >= 0.95x
the full cache, and >= Quest-like with 4-bit pages (the equal-memory twin of the 8:1 runs) minus 2 points.
Beside them the retention alone at 16 bits (``kvzip_local``), the 8:1 paged design of the earlier runs
(``sekv_pages32_v2``) and whole-cache 4-bit KIVI for its bytes.

The loop, the measurement and the byte counts are :mod:`kvstate.lab.semantic.realmodel`'s (one prefill per item,
every in-process method from it, bytes against a bf16 full cache); this module adds its runs to that module's
:data:`~kvstate.lab.semantic.realmodel.RUNS` registry and declares its own experiment, so the 8:1 paged runs
already committed keep their code. Run as a module::

    OMP_NUM_THREADS=1 python -m kvstate.lab.semantic.realmodel8 --set test --n 100 --seed SEED \\
        --out models/smollm2/sekv8_2048.json

``--set pilot`` (dev seeds, a result file under ``docs/results/``) is the grid the configuration was chosen on.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from kvstate.lab.semantic import realmodel as base
from kvstate.lab.semantic.realmodel import FULL_2K, MEMORY_BF16, READS, TASKS, TWIN, Run

EXPERIMENT = "sekv8-retention-real"
# The retention's memory for 8:1 reads: it reads what it keeps, plus the question and the answer, which every method
# holds exact (~0.016 of the 2K context's bf16 K/V on the one-item check below); 0.105 keeps the peak read within
# 0.125 of the full cache's — the budget the Quest-like twin reads. Set by that arithmetic, not tuned on scores.
RETAIN = 0.105
OWN_RUNS = (
    Run(f"sekv_zip@{RETAIN}", "sekv_zip", RETAIN),  # 4-bit keys and values (the 16:1 pilot's choice)
    Run(f"sekv_zip_v2@{RETAIN}", "sekv_zip_v2", RETAIN),  # 4-bit keys, 2-bit values: more tokens in the same memory
    Run(f"kvzip_local@{RETAIN}", "kvzip_local", RETAIN),  # the same retention at 16 bits (its twin at equal memory)
)
for _r in OWN_RUNS:  # registered beside the 8:1 runs (one name, one run)
    if base.RUNS.setdefault(_r.label, _r) != _r:
        raise RuntimeError(f"realmodel8: run {_r.label!r} is registered twice with different settings")
PROPOSED = f"sekv_zip@{RETAIN}"
SETS = {
    # a check of the reads on dev seeds (every design beside the twin)
    "pilot": ("full", PROPOSED, f"sekv_zip_v2@{RETAIN}", f"kvzip_local@{RETAIN}", "sekv_pages32_v2@0.125", TWIN),
    # the 16:1 pilot's design (docs/results/smollm2_sekv16_pilot_{single,multikey}.json) at 8:1, its 2-bit-value
    # ablation and its 16-bit twin (both share its scores: seconds), the 8:1 paged design and Quest-like with 4-bit
    # pages (the equal-memory twin)
    "test": ("full", PROPOSED, f"sekv_zip_v2@{RETAIN}", f"kvzip_local@{RETAIN}", "sekv_pages32_v2@0.125", TWIN),
}
PAIRS = tuple((PROPOSED, b) for b in ("full", TWIN, f"sekv_zip_v2@{RETAIN}", f"kvzip_local@{RETAIN}",
                                      "sekv_pages32_v2@0.125"))


def targets(methods: Sequence[str]) -> tuple[Any, ...]:
    """Issue 48's 8:1 targets for :data:`PROPOSED` (worded as :func:`kvstate.lab.semantic.realmodel.targets`), when
    the full cache and the equal-memory twin run beside it."""
    from kvstate.lab.experiment import Target

    if PROPOSED not in methods or "full" not in methods or TWIN not in methods:
        return ()
    return (Target(f"SEKV ({PROPOSED}, <= {MEMORY_BF16} x bf16 memory) >= 0.95 x full at 8:1 reads: "
                   f"SEKV - full >= {-0.05 * FULL_2K:.4f}", PROPOSED, "difference", -0.05 * FULL_2K, against="full"),
            Target(f"SEKV ({PROPOSED}) >= Quest-like with 4-bit pages ({TWIN}, the equal-memory twin) - 2 points at "
                   "8:1 reads", PROPOSED, "difference", -0.02, against=TWIN))


def plan(model_dir: Path, labels: Sequence[str], lengths: Sequence[int], n: int, seed: int,
         tasks: Sequence[str] = TASKS) -> Any:
    """:func:`kvstate.lab.semantic.realmodel.plan`'s experiment under this run's name, targets and code."""
    import dataclasses

    e = base.plan(model_dir, labels, lengths, n, seed, tasks)
    return dataclasses.replace(e, name=EXPERIMENT, targets=targets(labels),
                               code=(*e.code, "lab/semantic/realmodel8.py", "semantic/retention.py",
                                     "lab/semantic/methods/sekv_zip.py"))


def pairs(e: Any, records: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The paired differences of :data:`PAIRS`, per task and pooled over the tasks the full cache solves."""
    from kvstate.lab import protocol, stats

    scores = {lab: {t: [r["scores"][lab] for r in records if r["task"] == t] for t in e.tasks} for lab in e.methods}
    split = protocol.solved_tasks(scores["full"]) if "full" in scores else None
    out = []
    for a, b in PAIRS:
        if a not in scores or b not in scores:
            continue
        cells = {t: (scores[a][t], scores[b][t]) for t in e.tasks}
        if split is not None and split.solved:
            cells["pooled (solved)"] = (split.pool(scores[a]), split.pool(scores[b]))
        for where, (x, y) in cells.items():
            if x:
                d = stats.paired_difference(x, y, seed=e.seeds[0])
                out.append({"a": a, "b": b, "task": where, "n": d.n, "difference": round(d.value, 4),
                            "ci": [round(d.lo, 4), round(d.hi, 4)]})
    return out


def reads_checks(e: Any, records: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per method the peak read over its items against a bf16 full cache, and whether it is within 8:1."""
    out = []
    for lab in e.methods:
        peak = max((r["extra"][lab]["bf16"]["reads"] for r in records), default=None)
        out.append({"method": lab, "reads_bf16_max": peak, f"reads_le_{READS}_bf16": peak is not None and peak <= READS})
    return out


def main(argv: list[str] | None = None) -> int:
    from kvstate.errors import KVStateError
    from kvstate.lab.experiment import check_out, items, run_items
    from kvstate.lab.harness import load_reference
    from kvstate.lab.journal import Journal
    from kvstate.lab.lists import parse_ints, parse_names
    from kvstate.lab.models.cli import REAL_MODEL

    ap = argparse.ArgumentParser(prog="python -m kvstate.lab.semantic.realmodel8", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=REAL_MODEL)
    ap.add_argument("--set", choices=tuple(SETS), default="test")
    ap.add_argument("--methods", default=None, help="loop names, comma-separated (default: the --set's)")
    ap.add_argument("--task", default=",".join(TASKS))
    ap.add_argument("--length", default="2048")
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--overwrite", action="store_true")
    a = ap.parse_args(argv)
    try:
        labels = parse_names(a.methods, "--methods", list(base.RUNS)) if a.methods else list(SETS[a.set])
        tasks = parse_names(a.task, "--task", list(TASKS))
        e = plan(a.model, labels, parse_ints(a.length, "--length", lo=64), a.n, a.seed, tasks)
        check_out(e, a.out, overwrite=a.overwrite)  # the output and the seed ledger before the weights load
        torch.set_num_threads(1)
        model, tok = load_reference(a.model)
        measure = base.Measure(model, tok, labels)

        def appendix(journal: Journal | None) -> dict[str, Any]:
            recs = []
            for it in items(e):
                got = journal.get(it.unit) if journal is not None else measure.kept[it.unit]
                recs.append({"task": it.task, "length": it.length, "index": it.index, **got})
            return {"summary": {**base.summary(e, recs), "pairs": pairs(e, recs)}, "reads_checks": reads_checks(e, recs)}

        def keep(item: Any) -> Any:
            got = measure(item)
            measure.kept[item.unit] = {"scores": dict(got.scores), "extra": dict(got.extra)}
            return got

        doc = run_items(e, keep if a.out is None else measure, out=a.out, overwrite=a.overwrite,
                        command=" ".join(["python", "-m", "kvstate.lab.semantic.realmodel8",
                                          *(argv if argv is not None else sys.argv[1:])]),
                        progress=True, say=lambda m: print(m, file=sys.stderr), appendix=appendix)
    except KVStateError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    base.print_table(doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
