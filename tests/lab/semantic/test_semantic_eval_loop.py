"""`kvstate semantic eval` runs through the lab's experiment loop: one row schema, solved-task pooling, the ledger
checked before any weight is read."""

import json
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from kvstate.cli import app
from kvstate.errors import KVStateError
from kvstate.lab import experiment as X
from kvstate.lab import ledger as L
from kvstate.lab.semantic import evaluate as E
from kvstate.lab.semantic.protocol import MULTI_Q


def outcome(method, budget, task, index, score, question=0, length=256):
    return SimpleNamespace(method=method, budget=budget, task=task, length=length, index=index, question=question,
                           score=score)


def plan(n=4, tasks=("niah_single", "niah_multikey")):
    runs = [("full", 1.0), ("sekv", 0.25), ("quest", 0.25)]
    return runs, E.plan(runs, {}, [0.25], tasks, [256], n, 1000, [], {"recent": 16}, ["lab/stats.py"])


def test_scores_pool_only_the_cells_the_full_cache_solves():
    runs, planned = plan()
    got = []
    for i in range(4):
        got += [outcome("full", 1.0, "niah_single", i, 1.0), outcome("full", 1.0, "niah_multikey", i, float(i < 2)),
                outcome("sekv", 0.25, "niah_single", i, float(i < 3)), outcome("sekv", 0.25, "niah_multikey", i, 1.0),
                outcome("quest", 0.25, "niah_single", i, 0.0), outcome("quest", 0.25, "niah_multikey", i, 0.0)]
    values = E.item_values(got)
    e = E.measured(planned, values, runs)
    assert e.methods == ("full@1", "sekv@0.25", "quest@0.25") and e.ref == "full@1"
    doc = E.run_loop(e, values)
    assert all(tuple(r) == X.ROW_KEYS and r["n"] == 4 for r in doc["rows"])
    pool = doc["pooled"]
    assert pool["tasks"] == ["niah_single@256"] and pool["excluded_tasks"] == {"niah_multikey@256": 0.5}
    assert pool["methods"]["sekv@0.25"]["value"] == 0.75  # its perfect multikey score is not pooled
    assert pool["methods"]["sekv@0.25"]["n"] == 4


def test_four_questions_make_one_value_per_item_and_a_partial_method_is_refused():
    runs, planned = plan(n=2, tasks=(MULTI_Q,))
    got = [outcome(m, b, MULTI_Q, i, float(q < k), question=q)
           for m, b, k in (("full", 1.0, 4), ("sekv", 0.25, 3), ("quest", 0.25, 1)) for i in range(2) for q in range(4)]
    values = E.item_values(got)
    assert values[("sekv@0.25", MULTI_Q, 256)] == [0.75, 0.75]
    e = E.measured(planned, values, runs)
    assert e.tasks == (MULTI_Q,) and e.methods == ("full@1", "sekv@0.25", "quest@0.25")
    del values[("quest@0.25", MULTI_Q, 256)][-1]  # one item missing
    with pytest.raises(KVStateError, match=r"\['quest@0.25'\] answered only part"):
        E.measured(planned, values, runs)


def test_a_perplexity_only_run_has_no_loop_rows_and_a_missing_reference_falls_back():
    runs, planned = plan(tasks=("ppl",))
    assert E.measured(planned, {}, runs) is None
    runs2 = [("sekv", 0.25), ("quest", 0.25)]
    planned2 = E.plan(runs2, {}, [0.25], ["niah_single"], [256], 1, 1000, [], {}, [])
    values = {("sekv@0.25", "niah_single", 256): [1.0], ("quest@0.25", "niah_single", 256): [0.0]}
    e = E.measured(planned2, values, runs2)
    assert e.reference is None and e.ref == "sekv@0.25"


def test_cli_writes_the_loop_rows_beside_the_bench_view(tmp_path, model_dir):
    out = tmp_path / "eval.json"
    r = CliRunner().invoke(app, ["semantic", "eval", "--model", str(model_dir[0]), "--task", f"niah_single,{MULTI_Q}",
                                 "--length", "128", "--n", "2", "--methods", "full,sekv,quest", "--budget", "0.9,0.02",
                                 "--recent", "8", "--max-span", "8", "--slow-budget", "0.6", "--out", str(out)])
    assert r.exit_code == 0, r.output
    [run] = json.loads(out.read_text())["runs"]
    assert [e["method"] for e in run["not_run"]][:1] == ["sekv"] and "sekv@0.02" not in run["experiment"]["methods"]
    assert run["experiment"]["axis"] == "resolution" and run["pooled"]["reference"] == "full@1"
    assert {"full@1", "sekv@0.9", "quest@0.9"} <= set(run["experiment"]["methods"])
    assert all(tuple(x) == X.ROW_KEYS and x["n"] == 2 for x in run["rows"])
    # the loop's per-item values are the bench's per-question scores, four questions averaged per item
    cells = [c for c in run["cells"] if c["method"] == "sekv" and c["budget"] == 0.9 and c["task"] == MULTI_Q]
    want = [sum(c["score"] for c in cells if c["index"] == i) / 4 for i in range(2)]
    [row] = [x for x in run["rows"] if x["method"] == "sekv@0.9" and x["task"] == MULTI_Q]
    assert row["values"] == pytest.approx(want)
    # the provenance (and so the seed ledger) names every method as asked, the failed one included
    assert "sekv@0.02" in run["provenance"]["settings"]["methods"] and run["provenance"]["seeds"] == [0]
    assert {x["method"] for x in run["results"]} >= {"full", "sekv", "quest"}  # the bench's view is kept


def test_a_dev_seed_into_models_is_refused_before_the_weights_load(tmp_path, model_dir, monkeypatch):
    root = tmp_path / "models"
    (root / "m-sekv").mkdir(parents=True)
    monkeypatch.setattr(L, "results_root", lambda: root)
    loaded = []
    monkeypatch.setattr("kvstate.lab.harness.load_reference", lambda *a, **k: loaded.append(a))
    out = root / "m-sekv" / "eval.json"
    r = CliRunner().invoke(app, ["semantic", "eval", "--model", str(model_dir[0]), "--length", "128", "--n", "1",
                                 "--methods", "full,sekv", "--budget", "0.5", "--seed", "3", "--out", str(out)])
    assert isinstance(r.exception, L.SeedRefused) and "eval.json: --seed 3 is a dev seed" in str(r.exception)
    assert loaded == [] and not out.exists()
