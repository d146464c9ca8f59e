"""`kvstate prefix replay-bench`: the replay the report reads, with one door — the seed ledger before any work."""

import pytest

from kvstate.lab import ledger as L
from kvstate.lab.prefix import bench
from kvstate.lab.prefix.cli import _grid


def test_a_dev_seed_into_models_is_refused_before_the_model_loads(tmp_path, monkeypatch):
    root = tmp_path / "models"
    (root / "ref-hybrid").mkdir(parents=True)
    monkeypatch.setattr(L, "results_root", lambda: root)
    loaded = []
    monkeypatch.setattr("kvstate.models.load_model", lambda *a, **k: loaded.append(a))
    out = root / "ref-hybrid" / "prefix_replay.json"
    with pytest.raises(L.SeedRefused, match=r"prefix_replay.json: --seed 3 is a dev seed.*--seed 1000"):
        bench.run_bench(bench.ReplayBench(seed=3, model=tmp_path / "nowhere"), out)
    assert loaded == [] and not out.exists()


def test_the_grid_option_takes_budget_slot_pairs_only():
    assert _grid("1073741824:8,16777216:2") == ((1073741824, 8), (16777216, 2))
    for bad in ("8", "a:b", "0:8", ""):
        with pytest.raises(Exception, match="budget:slots pairs"):
            _grid(bad)
