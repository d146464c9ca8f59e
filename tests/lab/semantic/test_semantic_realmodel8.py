"""The 8:1 retention run on the real model: its runs join the 8:1 registry without changing one already there, its
test set carries issue 48's two 8:1 targets for the retention design (none without the full cache and the twin),
its experiment is its own (name, targets, code), and its appendix pairs the proposed configuration with each rival
and checks every method's peak read against 1/8 of a bf16 cache."""

import importlib

import pytest

from kvstate.lab import experiment as X
from kvstate.lab.semantic import methods as registry
from kvstate.lab.semantic import realmodel as base
from kvstate.lab.semantic import realmodel8 as R


def test_its_runs_are_registered_and_every_set_names_registered_methods():
    for run in R.OWN_RUNS:
        assert base.RUNS[run.label] is run
    for labels in R.SETS.values():
        for lab in labels:
            registry.get(base.RUNS[lab].method)
    assert R.RETAIN + 0.016 <= R.READS  # the question and the answer fit within 8:1 reads


def test_a_run_registered_twice_with_other_settings_is_refused():
    kept = base.RUNS[R.PROPOSED]
    base.RUNS[R.PROPOSED] = base.Run(R.PROPOSED, "sekv_zip", 0.2)
    try:
        with pytest.raises(RuntimeError, match="registered twice"):
            importlib.reload(R)
    finally:
        base.RUNS[R.PROPOSED] = kept
        importlib.reload(R)


def test_the_test_set_targets_the_retention_design_against_full_and_the_twin(tmp_path):
    t = R.targets(R.SETS["test"])
    assert [(x.method, x.against, x.threshold) for x in t] == [(R.PROPOSED, "full", -0.05 * R.FULL_2K),
                                                              (R.PROPOSED, R.TWIN, -0.02)]
    assert R.targets(("full", R.PROPOSED)) == () and R.targets((R.PROPOSED, R.TWIN)) == ()
    e = R.plan(tmp_path, R.SETS["test"], (2048,), 100, 1102)
    assert e.name == R.EXPERIMENT != base.EXPERIMENT and e.targets == t and "lab/semantic/realmodel8.py" in e.code


def _record(task: str, i: int, scores: dict, reads: dict) -> dict:
    return {"task": task, "length": 2048, "index": i, "scores": scores,
            "extra": {lab: {"bf16": {"memory": reads[lab], "reads": reads[lab]}} for lab in scores}}


def test_the_appendix_pairs_each_rival_and_checks_the_reads():
    labels = ("full", R.PROPOSED, R.TWIN)
    e = X.Experiment(axis="resolution", name=R.EXPERIMENT, methods=labels, seeds=(495,),
                     tasks=("real_niah_single", "real_niah_multikey"), lengths=(2048,), n=4, reference="full")
    recs = [_record(t, i, {"full": 1.0, R.PROPOSED: float(i % 2), R.TWIN: 0.0},
                    {"full": 1.0, R.PROPOSED: 0.12 + 0.01 * (t == "real_niah_multikey" and i == 3), R.TWIN: 0.125})
            for t in e.tasks for i in range(4)]
    pairs = {(p["b"], p["task"]): p["difference"] for p in R.pairs(e, recs)}
    assert pairs[("full", "pooled (solved)")] == -0.5 and pairs[(R.TWIN, "real_niah_multikey")] == 0.5
    assert not any(b == f"kvzip_local@{R.RETAIN}" for b, _ in pairs)  # not run: not paired
    checks = {c["method"]: c[f"reads_le_{R.READS}_bf16"] for c in R.reads_checks(e, recs)}
    assert checks == {"full": False, R.PROPOSED: False, R.TWIN: True}  # one item read 0.13
