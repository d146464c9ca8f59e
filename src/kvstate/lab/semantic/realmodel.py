"""SEKV against the equal-memory baselines on the real model (issue 48), every byte against a bf16 full cache.

The real model (``models/smollm2-135m-instruct``) on its real-text needle tasks (``real_niah_single``,
``real_niah_multikey``: :func:`kvstate.lab.semantic.protocol.build_items`'s ``real_*`` items, the reference table's
items), through the lab's item-major loop (:func:`kvstate.lab.experiment.run_items`: one prefill per item shared
by every method, the seed ledger before the weights load, a journal so an interrupted run resumes, targets
decided on paired intervals). Each method is a registered method of :mod:`kvstate.lab.semantic.methods` at a
budget, with SEKV's options (:class:`~kvstate.lab.semantic.methods.SekvOptions`) where it has them; its loop name
says both (``sekv@0.125``, ``sekv_b2@0.125``: SEKV with 2-bit codes). Every answer records the byte counts of
the bench (the fp32 tensors held) and the same counts against a bf16 full cache (:mod:`kvstate.lab.semantic.bf16`:
codes as held, every floating tensor as bf16, routing metadata counted as read); the appendix gives, per method
and task, memory (every tier) and peak reads over the full cache in both, and the paired differences of
:data:`PAIRS`. Run as a module::

    OMP_NUM_THREADS=1 python -m kvstate.lab.semantic.realmodel --set test --n 100 --seed 1060 \\
        --out models/smollm2/sekv_2048.json

``--set pilot`` (a dev seed, a result file outside ``models/``) is the grid the configuration was chosen on.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvstate.lab.semantic.methods.base import SekvOptions, StoreMethod
from kvstate.semantic.config import RouteQuery

EXPERIMENT = "sekv-real"
TASKS = ("real_niah_single", "real_niah_multikey")
READS = 0.125  # 8:1 reads


@dataclass(frozen=True)
class Run:
    """One row: a registered method at a budget, with SEKV's options (ignored by the others)."""

    label: str  # the loop's and the ledger's name
    method: str
    budget: float
    options: SekvOptions = field(default_factory=SekvOptions)
    route_query: RouteQuery = "last"  # which of the question's queries rank spans / pages ("all": the max over them)


ALL: RouteQuery = "all"
RUNS = {r.label: r for r in (
    Run("full", "full", 1.0),
    Run("sekv@0.125", "sekv", READS),  # the library default (4-bit slow tier, slow_budget 0.375)
    Run("sekv_all@0.125", "sekv", READS, route_query=ALL),
    Run("sekv_b2@0.125", "sekv", READS, SekvOptions(bits=2)),
    Run("sekv_b2_all@0.125", "sekv", READS, SekvOptions(bits=2), ALL),
    Run("sekv_b2m_all@0.125", "sekv", READS, SekvOptions(memory=0.21, bits=2), ALL),  # memory: fp32 terms
    Run("quest@0.125", "quest", READS),
    Run("quest_all@0.125", "quest", READS, route_query=ALL),
    Run("quest4@0.125", "quest4", READS),
    Run("quest4_all@0.125", "quest4", READS, route_query=ALL),
    Run("quest2_all@0.125", "quest2", READS, route_query=ALL),
    Run("kivi@0.25", "kivi", 0.25),  # the most bits within 0.25 x fp32: 4-bit
    Run("kivi@0.125", "kivi", READS),  # 2-bit (its reads are what it holds: 8:1 of fp32)
    Run("streaming@0.125", "streaming", READS),
    # the routing probe's design (kvstate.lab.semantic.real_routing): pages read as 4-bit codes, ranked by mean key
    Run("sekv_pages16@0.125", "sekv_pages16", READS),
    Run("sekv_pages32@0.125", "sekv_pages32", READS),
    Run("sekv_pages64@0.125", "sekv_pages64", READS),
    Run("sekv_pages32_all@0.125", "sekv_pages32", READS, route_query=ALL),
    Run("sekv_pages32_v2@0.125", "sekv_pages32_v2", READS),
)}
SETS = {
    "pilot": tuple(RUNS),
    # the second pilot (dev seeds 486 / 487): the routing probe's design against its equal-memory twin
    "pages": ("full", "quest4_all@0.125", "sekv_pages16@0.125", "sekv_pages32@0.125", "sekv_pages64@0.125",
              "sekv_pages32_all@0.125", "sekv_pages32_v2@0.125", "kivi@0.25"),
    # chosen on the pilot (docs/results/smollm2_sekv_pilot_2048.json, dev seed 480): SEKV's one configuration within
    # 0.30 x bf16 memory, its equal-memory twins (Quest-like with 4-bit and 2-bit pages, ranked by the same queries)
    # and the library default (4-bit, 0.42 x bf16) for its bytes
    "test": ("full", "sekv_b2m_all@0.125", "quest4_all@0.125", "quest2_all@0.125", "sekv@0.125"),
    # chosen on the pages pilot (docs/results/smollm2_sekv_pages_pilot_{single,multikey}.json, dev seeds 486 / 487):
    # the one paged configuration within 0.30 x bf16 memory (4-bit keys, 2-bit values, 32-token pages), the best
    # scoring one (16-token pages, 0.38 x), the equal-memory twin, and whole-cache 4-bit KIVI for its bytes
    "test_pages": ("full", "sekv_pages32_v2@0.125", "sekv_pages16@0.125", "quest4_all@0.125", "kivi@0.25"),
}
PROPOSED = "sekv_b2m_all@0.125"  # SEKV's configuration within 0.30 x bf16 memory (the pilot's choice)
PROPOSED_PAGES = "sekv_pages32_v2@0.125"  # the pages pilot's configuration within 0.30 x bf16 memory
TWIN = "quest4_all@0.125"  # Quest-like with 4-bit pages, the equal-memory twin
PAIRS = ((PROPOSED, "full"), (PROPOSED, TWIN), (PROPOSED, "quest2_all@0.125"), ("sekv@0.125", "full"),
         ("sekv@0.125", "quest4@0.125"), ("sekv_all@0.125", "quest4_all@0.125"),
         ("sekv_pages32@0.125", "full"), ("sekv_pages32@0.125", TWIN), ("sekv_pages64@0.125", "full"),
         (PROPOSED_PAGES, "full"), (PROPOSED_PAGES, TWIN), ("sekv_pages16@0.125", "full"),
         ("sekv_pages16@0.125", TWIN))
MEMORY_BF16 = 0.30  # the memory cap, every tier / bf16 full cache
# issue 48's 8:1 targets, committed before the test run that decides them; pooled over the tasks the full cache
# solves on the run (>= 0.9). ">= 0.95 x full" is a paired difference >= -0.05 x 0.99, the full cache's
# niah_single score at 2,048 tokens in the reference table (models/smollm2/realtext_2048.json, the one solved
# cell there).
FULL_2K = 0.99


def targets(methods: Sequence[str]) -> tuple[Any, ...]:
    """Issue 48's 8:1 targets for the run's proposed configuration (the first of :data:`PROPOSED` and
    :data:`PROPOSED_PAGES` it holds), when the full cache and the equal-memory twin run beside it."""
    from kvstate.lab.experiment import Target

    proposed = next((p for p in (PROPOSED, PROPOSED_PAGES) if p in methods), None)
    if proposed is None or "full" not in methods or TWIN not in methods:
        return ()
    return (Target(f"SEKV ({proposed}, <= {MEMORY_BF16} x bf16 memory) >= 0.95 x full at 8:1 reads: "
                   f"SEKV - full >= {-0.05 * FULL_2K:.4f}", proposed, "difference", -0.05 * FULL_2K, against="full"),
            Target(f"SEKV ({proposed}) >= Quest-like with 4-bit pages ({TWIN}, the equal-memory twin) - 2 points at "
                   "8:1 reads", proposed, "difference", -0.02, against=TWIN))


def plan(model_dir: Path, labels: Sequence[str], lengths: Sequence[int], n: int, seed: int,
         tasks: Sequence[str] = TASKS) -> Any:
    from kvstate.lab.experiment import Experiment
    from kvstate.lab.semantic.cli import EVAL_CODE

    runs = {lab: RUNS[lab] for lab in labels}
    return Experiment(axis="resolution", name=EXPERIMENT, methods=tuple(labels), seeds=(seed,), tasks=tuple(tasks),
                      lengths=tuple(lengths), n=n, reference="full", targets=targets(labels),
                      code=(*EVAL_CODE, "lab/semantic/realmodel.py", "lab/semantic/bf16.py"),
                      models=(str(model_dir),),
                      settings={"runs": {lab: {"method": r.method, "budget": r.budget, "memory": r.options.memory,
                                               "slow": r.options.slow, "bits": r.options.bits,
                                               "route_query": r.route_query}
                                         for lab, r in runs.items()},
                                "recent": 16, "max_span": 32, "expand_share": 0.6, "slow_budget": 0.375,
                                "router": "untrained (bounds routing reads none)", "threads": 1, "dtype": "float32",
                                "bytes": "fp32 as held and against a bf16 full cache (kvstate.lab.semantic.bf16)"})


def _ratios(b: Any, full: int) -> dict[str, float]:
    f = max(full, 1)
    return {"memory": round(b.total_bytes / f, 5), "resident": round(b.resident_bytes / f, 5),
            "reads": round(b.attended_bytes_peak / f, 5)}


class Measure:
    """Scores every run on one item from one prefill (:func:`kvstate.lab.experiment.run_items`'s function)."""

    def __init__(self, model: Any, tokenizer: Any, labels: Sequence[str]) -> None:
        from kvstate.semantic.router import RouterConfig, SemanticRouter
        from kvstate.semantic.segment import SegmentConfig

        self.model, self.tok, self.labels = model, tokenizer, list(labels)
        self.router = SemanticRouter(RouterConfig.from_model_config(model.config))
        self.segment = SegmentConfig(recent=16, max_span=32)
        self.kept: dict[str, dict[str, Any]] = {}  # without a journal: each item's record, for the appendix

    @torch.no_grad()
    def __call__(self, item: Any) -> Any:
        from kvstate.lab.experiment import ItemResult
        from kvstate.lab.semantic import bench, bf16
        from kvstate.lab.semantic import methods as registry
        from kvstate.lab.semantic.protocol import _real_item

        it = _real_item(self.tok, item.task, item.length, item.seed, item.index)
        t0 = time.perf_counter()
        pre = bench.prefill(self.model, it)
        extra: dict[str, Any] = {"depth": it.depth, "answers": it.answers[0], "context_tokens": len(it.context),
                                 "prefill_s": round(time.perf_counter() - t0, 2)}
        scores: dict[str, float] = {}
        for lab in self.labels:
            r = RUNS[lab]
            m = registry.get(r.method)
            ctx = registry.Context(self.router, self.segment, 0.6, 0.375, r.options)
            t = time.perf_counter()
            cfg = m.config(r.budget, ctx)
            if cfg is not None and cfg.route_query != r.route_query:
                # the method's own settings with the question's every query ranking (the store reads it from the
                # config; SEKV's fork reads ctx.config, the others keep the cache's)
                cfg = dataclasses.replace(cfg, route_query=r.route_query)
                ctx = dataclasses.replace(ctx, config=cfg)
                assert isinstance(m, StoreMethod)
                cache = m.cache_class(self.model, m.router(ctx), cfg)
                cache.adopt(pre.cache)
                m.compress(cache, self.tok, it.context, pre)
            else:
                cache = m.build(self.model, self.tok, it.context, r.budget, ctx, pre)
            built = time.perf_counter() - t
            work = m.fork(cache, r.budget, ctx)
            with m.attention(self.model):
                pred, dt, steps = bench._answer(self.model, work, it.questions[0], len(it.context),
                                                it.max_new_tokens[0], self.tok.eos_token_id, self.tok)
            scores[lab] = bench.score_prediction(it, 0, pred)
            b32, ratio = m.counts(work)
            b16 = bf16.counts(work)
            extra[lab] = {"reply": pred[:200], "fp32": _ratios(b32, b32.full_bytes),
                          "bf16": _ratios(b16, b16.full_bytes), "read_ratio_peak": round(ratio, 5),
                          "bytes_fp32": b32.as_dict(), "bytes_bf16": b16.as_dict(),
                          "expanded": m.expanded(work), "bits": getattr(cache, "bits", None),
                          "build_s": round(built, 2), "decode_s": round(dt, 3), "steps": steps,
                          "seconds": round(time.perf_counter() - t, 2)}
        return ItemResult(scores, extra)


def summary(e: Any, records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Per method and task: score with its interval, memory / resident / reads against the full cache (fp32 as
    held and bf16; means, and the largest memory over items), seconds per item; the paired differences of
    :data:`PAIRS` per task and pooled over the tasks the full cache solves; the memory check."""
    from kvstate.lab import protocol, stats

    by: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    for r in records:
        for lab in e.methods:
            by.setdefault((lab, r["task"]), []).append({"score": r["scores"][lab], **r["extra"][lab]})
    rows = []
    for (lab, task), g in by.items():
        est = stats.rate([x["score"] for x in g], seed=e.seeds[0])
        row: dict[str, Any] = {"method": lab, "task": task, "n": len(g), "score": round(est.value, 4),
                               "ci": [round(est.lo, 4), round(est.hi, 4)]}
        for kind in ("bf16", "fp32"):
            for k in ("memory", "resident", "reads"):
                row[f"{k}_{kind}"] = round(sum(x[kind][k] for x in g) / len(g), 4)
            row[f"memory_{kind}_max"] = round(max(x[kind]["memory"] for x in g), 4)
        row["seconds_per_item"] = round(sum(x["seconds"] for x in g) / len(g), 2)
        bits = {x["bits"] for x in g if x["bits"] is not None}
        if bits:
            row["bits"] = sorted(bits)
        rows.append(row)
    scores = {lab: {t: [r["scores"][lab] for r in records if r["task"] == t] for t in e.tasks} for lab in e.methods}
    split = protocol.solved_tasks(scores["full"]) if "full" in scores else None
    pairs = []
    for a, b in PAIRS:
        if a not in scores or b not in scores:
            continue
        cells = {t: (scores[a][t], scores[b][t]) for t in e.tasks}
        if split is not None and split.solved:
            cells["pooled (solved)"] = (split.pool(scores[a]), split.pool(scores[b]))
        for where, (x, y) in cells.items():
            if not x:
                continue
            d = stats.paired_difference(x, y, seed=e.seeds[0])
            pairs.append({"a": a, "b": b, "task": where, "n": d.n, "difference": round(d.value, 4),
                          "ci": [round(d.lo, 4), round(d.hi, 4)]})
    checks = []
    for lab in e.methods:
        worst = max((row["memory_bf16_max"] for row in rows if row["method"] == lab), default=None)
        reads = max((x["bf16"]["reads"] for r in records for x in [r["extra"][lab]]), default=None)
        checks.append({"method": lab, "memory_bf16_max": worst, "reads_bf16_max": reads,
                       "memory_le_0.30_bf16": worst is not None and worst <= MEMORY_BF16})
    return {"rows": rows, "pairs": pairs, "solved": None if split is None else split.solved,
            "excluded": None if split is None else split.excluded, "memory_checks": checks}


def print_table(doc: Mapping[str, Any]) -> None:
    s = doc["appendix"]["summary"]
    print(f"{'method':<18}{'task':<20}{'n':>4}{'score':>7}  {'95% CI':<16}{'mem bf16':>9}{'max':>7}{'reads bf16':>11}"
          f"{'mem fp32':>9}{'reads fp32':>11}{'s/item':>8}", file=sys.stderr)
    for r in s["rows"]:
        print(f"{r['method']:<18}{r['task']:<20}{r['n']:>4}{r['score']:>7.3f}  [{r['ci'][0]:.3f}, {r['ci'][1]:.3f}]  "
              f"{r['memory_bf16']:>9.3f}{r['memory_bf16_max']:>7.3f}{r['reads_bf16']:>11.3f}{r['memory_fp32']:>9.3f}"
              f"{r['reads_fp32']:>11.3f}{r['seconds_per_item']:>8.1f}", file=sys.stderr)
    for p in s["pairs"]:
        print(f"{p['a']} - {p['b']} on {p['task']} (n={p['n']}): {p['difference']:+.3f} "
              f"[{p['ci'][0]:+.3f}, {p['ci'][1]:+.3f}]", file=sys.stderr)
    for d in doc.get("decisions", []):
        print(f"target: {d['label']}: {d['status']} ({d['value']}, {d['ci']})", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    from kvstate.errors import KVStateError
    from kvstate.lab.experiment import check_out, run_items
    from kvstate.lab.harness import load_reference
    from kvstate.lab.journal import Journal
    from kvstate.lab.lists import parse_ints, parse_names
    from kvstate.lab.models.cli import REAL_MODEL

    ap = argparse.ArgumentParser(prog="python -m kvstate.lab.semantic.realmodel", description=__doc__.split("\n\n")[0])
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
        labels = parse_names(a.methods, "--methods", list(RUNS)) if a.methods else list(SETS[a.set])
        tasks = parse_names(a.task, "--task", list(TASKS))
        e = plan(a.model, labels, parse_ints(a.length, "--length", lo=64), a.n, a.seed, tasks)
        check_out(e, a.out, overwrite=a.overwrite)  # the output and the seed ledger before the weights load
        torch.set_num_threads(1)
        model, tok = load_reference(a.model)
        measure = Measure(model, tok, labels)

        def appendix(journal: Journal | None) -> dict[str, Any]:
            from kvstate.lab.experiment import items

            recs = []
            for it in items(e):
                got = journal.get(it.unit) if journal is not None else measure.kept[it.unit]
                recs.append({"task": it.task, "length": it.length, "index": it.index, **got})
            return {"summary": summary(e, recs)}

        if a.out is None:  # no journal: keep the records for the appendix
            inner = measure

            def keep(item: Any) -> Any:
                got = inner(item)
                measure.kept[item.unit] = {"scores": dict(got.scores), "extra": dict(got.extra)}
                return got

            fn: Any = keep
        else:
            fn = measure
        doc = run_items(e, fn, out=a.out, overwrite=a.overwrite, command=" ".join(["python", "-m", __spec__.name if
                        __spec__ else "kvstate.lab.semantic.realmodel", *(argv if argv is not None else sys.argv[1:])]),
                        progress=True, say=lambda m: print(m, file=sys.stderr), appendix=appendix)
    except KVStateError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print_table(doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
