"""The one experiment loop enforces the protocol: ledger before work, solved tasks only, decide() on intervals."""

import json

import numpy as np
import pytest

from kvstate.errors import KVStateError
from kvstate.lab import experiment as X
from kvstate.lab import ledger as L
from kvstate.lab import provenance as P


def quality(seeds=(1000,), targets=(), n=40, **kw):
    return X.Experiment(axis="resolution", name="toy", methods=("full", "half", "coin"), seeds=tuple(seeds),
                        tasks=("easy", "hard"), lengths=(64,), n=n, targets=tuple(targets), code=("lab/stats.py",),
                        **kw)


def oracle(cell):
    """full solves `easy` (1.0) but not `hard` (0.5); half scores half the items; coin is seeded noise."""
    i = np.arange(cell.n)
    if cell.method == "full":
        v = np.ones(cell.n) if cell.task == "easy" else (i % 2 == 0).astype(float)
    elif cell.method == "half":
        v = (i % 2 == 0).astype(float)
    else:
        v = np.random.default_rng(cell.seed + (cell.task == "hard")).integers(0, 2, cell.n).astype(float)
    return X.Measurement(list(v), {"calls": 1})


def test_a_dev_seed_into_models_is_refused_before_any_cell_runs(models):
    calls = []

    def measure(cell):
        calls.append(cell)
        return oracle(cell)

    with pytest.raises(L.SeedRefused) as e:
        X.run(quality(seeds=(0,)), measure, out=models / "m" / "eval.json")
    assert "\n" not in str(e.value) and "--seed 0 is a dev seed" in str(e.value) and "--seed 1000" in str(e.value)
    assert calls == [] and not (models / "m" / "eval.json").exists() and not (models / L.LEDGER_NAME).exists()


def test_a_used_test_seed_for_a_changed_method_names_the_ledger_entry(models):
    out = models / "m" / "eval.json"
    X.run(quality(), oracle, out=out)
    entries = L.read_ledger(models / L.LEDGER_NAME)
    assert sorted(entries) == ["lab:coin", "lab:full", "lab:half"] and entries["lab:full"][0].seed == 1000
    X.run(quality(), oracle, out=out)  # the same unchanged method re-scored: allowed
    calls = []
    with pytest.raises(L.SeedRefused) as e:  # a new hyperparameter makes it a different method
        X.run(quality(settings={"k": 2}), lambda c: calls.append(c) or oracle(c), out=out)
    msg = str(e.value)
    assert "\n" not in msg and "test seed 1000 is already in" in msg and "seeds_used.json for lab:" in msg
    assert "--seed 1001" in msg and calls == []
    assert len(P.read_runs(out)) == 2


def test_only_tasks_the_reference_solves_are_pooled_and_the_rest_shown_beside(tmp_path):
    t = X.Target("half keeps 0.9 of the full cache's score", "half", "difference", -0.1, against="full")
    res = X.run(quality(targets=[t]), oracle, out=tmp_path / "r.json")
    assert res["pooled"]["tasks"] == ["easy@64"]
    assert res["pooled"]["excluded_tasks"] == {"hard@64": 0.5}
    # pooled over `easy` only: full 1.0, half 0.5 on the same 40 items
    assert res["pooled"]["methods"]["full"]["value"] == 1.0 and res["pooled"]["methods"]["half"]["value"] == 0.5
    (d,) = res["decisions"]
    assert d["value"] == -0.5 and d["status"] == "missed" and d["n"] == 40
    assert d["tasks"] == ["easy@64"] and d["excluded_tasks"] == {"hard@64": 0.5} and d["seeds"] == [1000]
    run = P.read_runs(tmp_path / "r.json")[-1]
    assert set(run["rows"][0]) == set(X.ROW_KEYS) and len(run["rows"]) == 6
    assert run["provenance"]["settings"]["methods"] == ["full", "half", "coin"]
    assert X.headline_fields(d)["excluded_tasks"] == {"hard@64": 0.5}


def test_a_straddling_interval_is_undecided_never_met():
    t = X.Target("coin scores >= 0.5", "coin", "score", 0.5)
    res = X.run(quality(targets=[t], n=100), oracle)
    (d,) = res["decisions"]
    lo, hi = d["ci"]
    assert lo < 0.5 < hi and d["status"] == "undecided"
    met = X.run(quality(targets=[X.Target("full solves", "full", "score", 0.9)], n=100), oracle)["decisions"][0]
    assert met["status"] == "met" and met["ci"][1] - met["ci"][0] > 0  # all-1 sample: a Wilson width, not zero


def test_no_solved_task_decides_nothing():
    def bad(cell):
        return X.Measurement([0.0] * cell.n)

    d = X.run(quality(targets=[X.Target("half", "half", "score", 0.1)]), bad)["decisions"][0]
    assert d["status"] == "undecided" and d["tasks"] == [] and "solves no task" in d["why"]


def timing(repeats, targets=()):
    return X.Experiment(axis="position", name="toy-time", methods=("cache", "none"), seeds=(1000,), kind="timing",
                        repeats=repeats, targets=tuple(targets))


def test_a_timing_experiment_with_three_repeats_is_refused_before_it_runs():
    with pytest.raises(KVStateError, match=r"3 repeat\(s\); a timing experiment needs >= 5 interleaved repeats"):
        timing(3)


def test_timing_repeats_interleave_and_a_ratio_pairs_each_repeat():
    order = []

    def clock(cell):
        order.append((cell.repeat, cell.method))
        base = 1.0 + 0.1 * cell.repeat  # a machine that slows down: pairing per repeat cancels it
        return X.Measurement([base * (0.5 if cell.method == "cache" else 1.0)])

    t = X.Target("cache <= 0.6x no cache", "cache", "ratio", 0.6, higher_is_better=False, against="none")
    with pytest.raises(KVStateError, match="all 5 repeats are equal"):  # identical ratios: one value copied
        X.run(timing(5, [t]), clock)
    assert order[:4] == [(0, "cache"), (0, "none"), (1, "none"), (1, "cache")]

    def noisy(cell):
        r = cell.repeat
        return X.Measurement([(1.0 + 0.1 * r) * ((0.5 + 0.01 * r) if cell.method == "cache" else 1.0)])

    d = X.run(timing(5, [t]), noisy)["decisions"][0]
    assert d["status"] == "met" and d["repeats"] == 5 and d["ci"][1] <= 0.6 and d["n"] == 5


def test_bad_experiments_are_refused_with_one_line():
    with pytest.raises(KVStateError, match="axis 'width' is unknown; choose one of position"):
        X.Experiment(axis="width", name="x", methods=("a",), seeds=(1000,))
    with pytest.raises(KVStateError, match=r"method\(s\) \['b'\] not measured"):
        X.Experiment(axis="depth", name="x", methods=("a",), seeds=(1000,), targets=(X.Target("t", "b", "score", 1),))
    with pytest.raises(KVStateError, match="a difference target needs"):
        X.Experiment(axis="depth", name="x", methods=("a",), seeds=(1000,), targets=(X.Target("t", "a", "difference", 0),))
    with pytest.raises(KVStateError, match="returned 1 value"):
        X.run(quality(), lambda c: X.Measurement([1.0]))


def test_the_result_file_is_strict_json_with_provenance(tmp_path):
    X.run(quality(), oracle, out=tmp_path / "r.json")
    doc = json.loads((tmp_path / "r.json").read_text())
    prov = doc["runs"][0]["provenance"]
    assert prov["seeds"] == [1000] and prov["n"] == 40 and prov["tasks"] == ["easy", "hard"]
    assert "src/kvstate/lab/experiment.py" in prov["executed"]["files"]
