"""The item-major loop (:func:`kvstate.lab.experiment.run_items`): one call scores every method on an item, the
same rows / pooling / decisions as the method-major loop, and an interrupted run resumes from its journal."""

from __future__ import annotations

import numpy as np
import pytest

from kvstate.errors import KVStateError
from kvstate.lab import experiment as X
from kvstate.lab import ledger as L
from kvstate.lab import provenance as P
from kvstate.lab.journal import journal_path
from tests.lab.test_experiment import oracle, quality


def per_item(item: X.Item) -> X.ItemResult:
    """The method-major oracle's scores, read per item (so both loops see the same values)."""
    scores = {m: float(oracle(X.Cell(m, item.task, item.length, item.seed, 0, 40)).values[item.index])
              for m in ("full", "half", "coin")}
    return X.ItemResult(scores, {"index_seen": item.index})


def test_item_major_rows_pooling_and_decisions_equal_the_method_major_loop():
    target = X.Target("half within 0.6", "half", "score", 0.6, higher_is_better=False)
    e = quality(targets=(target,))
    a, b = X.run(e, oracle), X.run_items(e, per_item)
    assert [r["values"] for r in a["rows"]] == [r["values"] for r in b["rows"]]
    assert a["pooled"] == b["pooled"] and a["decisions"] == b["decisions"]
    assert len(b["items"]) == 2 * 40 and b["items"][3]["extra"] == {"index_seen": 1}


def test_an_interrupted_run_resumes_from_its_journal_and_scores_each_item_once(models):
    out = models / "m" / "eval.json"
    calls: list[str] = []

    def flaky(item):
        if len(calls) == 25:
            raise KeyboardInterrupt
        calls.append(item.unit)
        return per_item(item)

    with pytest.raises(KeyboardInterrupt):
        X.run_items(quality(), flaky, out=out)
    assert not out.exists() and journal_path(out).is_file() and len(calls) == 25
    done = list(calls)
    calls.clear()
    doc = X.run_items(quality(), lambda it: calls.append(it.unit) or per_item(it), out=out)
    assert not set(calls) & set(done) and len(calls) == 80 - 25
    assert not journal_path(out).exists()
    run = P.read_runs(out)[-1]
    assert run["provenance"]["parts"] == 2 and run["provenance"]["resumed_units"] == 25
    assert [r["values"] for r in run["rows"]] == [r["values"] for r in X.run(quality(), oracle)["rows"]]
    assert doc["pooled"]["methods"]["full"]["n"] == 40


def test_a_changed_experiment_never_mixes_in_another_runs_journal(models):
    out = models / "m" / "eval.json"
    with pytest.raises(KeyboardInterrupt):
        X.run_items(quality(), lambda it: (_ for _ in ()).throw(KeyboardInterrupt) if it.index == 3 else per_item(it),
                    out=out)
    said: list[str] = []
    calls: list[str] = []
    X.run_items(quality(settings={"k": 1}, seeds=(1001,)), lambda it: calls.append(it.unit) or per_item(it),
                out=out, say=said.append)
    assert len(calls) == 80 and any("moved aside" in s for s in said)


@pytest.mark.parametrize("bad, words", [
    (lambda it: X.ItemResult({"full": 1.0}), "scored methods ['full']"),
    (lambda it: X.ItemResult({"full": 1.0, "half": 2.0, "coin": 0.0}), "outside [0, 1]"),
    (lambda it: {"full": 1.0}, "return an ItemResult"),
])
def test_a_bad_item_result_is_refused_naming_the_item(bad, words):
    with pytest.raises(KVStateError) as e:
        X.run_items(quality(), bad)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_a_dev_seed_into_models_is_refused_before_any_item_runs(models):
    calls: list[X.Item] = []
    with pytest.raises(L.SeedRefused):
        X.run_items(quality(seeds=(0,)), lambda it: calls.append(it) or per_item(it), out=models / "m" / "e.json")
    assert calls == [] and not journal_path(models / "m" / "e.json").exists()


def test_a_timing_experiment_is_not_item_major():
    e = X.Experiment(axis="position", name="t", methods=("a", "b"), seeds=(0,), repeats=5, kind="timing")
    with pytest.raises(KVStateError) as ex:
        X.run_items(e, per_item)
    assert "run_items measures quality" in str(ex.value)


def test_items_interleave_tasks_within_each_index():
    got = [(i.task, i.index) for i in X.items(quality(n=2))]
    assert got == [("easy", 0), ("hard", 0), ("easy", 1), ("hard", 1)]
    assert np.all([isinstance(i.unit, str) for i in X.items(quality(n=2))])
