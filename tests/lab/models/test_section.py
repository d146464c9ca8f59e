"""The real-model report section reads committed result files only: the reference table with its intervals and
perplexity, the exchange with its decision, and a missing file named with the command that writes it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstate.lab import experiment as X
from kvstate.lab import ledger as L
from kvstate.lab.models import section


@pytest.fixture
def models(tmp_path, monkeypatch):
    root = tmp_path / "models"
    (root / section.RESULTS).mkdir(parents=True)
    monkeypatch.setattr(L, "results_root", lambda: root)
    return root


def reference(length: int, seed: int) -> X.Experiment:
    return X.Experiment(axis="reference", name="realtext-reference", methods=("full-cache",), seeds=(seed,),
                        tasks=("niah_single", "vt"), lengths=(length,), n=100, code=("lab/scoring.py",))


def test_the_section_shows_the_table_perplexity_and_which_cells_are_solved(models, tmp_path):
    def item(it: X.Item) -> X.ItemResult:
        return X.ItemResult({"full-cache": 1.0 if it.task == "niah_single" else float(it.index % 4 == 0)})

    appendix = {"perplexity": {"lengths": {"1024": {"windows": 8, "ppl": 12.5, "ci": [11.0, 14.0]}}}}
    X.run_items(reference(1024, 1100), item, out=models / section.RESULTS / "realtext_1024.json",
                appendix=lambda _j: appendix)
    out = tmp_path / "report"
    out.mkdir()
    s = section.build(out, models)
    assert s.summary["solved"] == ["niah_single@1024"] and s.summary["usable"] == []
    table = s.tables[0]
    assert table.rows[0][0] == "niah_single" and table.rows[0][1].startswith("1.00 [0.96, 1.00] (n = 100)")
    assert table.rows[1][1].startswith("0.25 [")
    assert s.tables[1].rows[0][:2] == ["1,024", "12.50"]
    assert (out / "smollm2_reference.png").is_file()
    missing = [r for r in s.headline if r.status == "missing"]
    assert sorted(Path(r.artifact).name for r in missing) == ["realtext_2048.json", "realtext_4096.json",
                                                               "serve_exchange.json"]
    check = next(r for r in s.headline if r.kind == "check")
    assert check.met is True and "n >= 100" in check.measured


def test_a_table_below_the_headline_n_fails_its_check(models, tmp_path):
    e = X.Experiment(axis="reference", name="realtext-reference", methods=("full-cache",), seeds=(1100,),
                     tasks=("niah_single",), lengths=(2048,), n=10, code=("lab/scoring.py",))
    X.run_items(e, lambda it: X.ItemResult({"full-cache": 1.0}), out=models / section.RESULTS / "realtext_2048.json")
    s = section.build(tmp_path, models)
    check = next(r for r in s.headline if r.kind == "check")
    assert check.met is False and "n >= 10" in check.measured


def test_nothing_committed_shows_the_commands(models, tmp_path):
    s = section.build(tmp_path, models)
    assert s.tables == [] and "No committed reference table" in s.conclusion
    assert all(r.status == "missing" for r in s.headline) and len(s.headline) == 4
    assert any("--length 4096 --n 100" in r.command for r in s.headline)
    assert json.loads(json.dumps(s.summary)) == s.summary and Path(tmp_path).is_dir()
