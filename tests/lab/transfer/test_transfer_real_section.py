"""The across-models section leads with the real pair: its premise run reads as a table of the three replies, the
decided premise becomes a headline row, the drift a table and a figure; no file names the command that writes it."""

from __future__ import annotations

from pathlib import Path

from kvstate.lab import experiment as X
from kvstate.lab.transfer import real_section
from kvstate.lab.transfer.realpair_eval import METHODS, ORACLE, RAW, experiment


def _commit(models: Path, raw_hits: int) -> None:
    e = experiment(Path("a"), Path("b"), ("niah_single",), (1024,), 20, 1100, 48)
    e = X.Experiment(**{**e.__dict__, "code": ("lab/scoring.py",), "models": ()})

    def item(it: X.Item) -> X.ItemResult:
        return X.ItemResult({ORACLE: 1.0, RAW: float(it.index < raw_hits), "producer": 1.0},
                            {"drift": {"k": [1.0, 0.9, 0.8], "v": [0.99, 0.7, 0.5]}})

    X.run_items(e, item, out=models / real_section.FILE,
                appendix=lambda _j: {"drift": {"drift_k": [1.0, 0.9, 0.8], "drift_v": [0.99, 0.7, 0.5], "items": 20}})


def test_a_losing_raw_reuse_meets_the_premise_and_the_drift_is_shown(models, tmp_path):
    _commit(models, raw_hits=4)
    tables, figures, head = real_section.build(models, tmp_path)
    assert [r[:2] for r in tables[0].rows] == [[m, "niah_single"] for m in METHODS]
    assert tables[0].rows[1][2].startswith("0.20 [") and tables[0].rows[1][3] == "1100"
    assert len(head) == 1 and head[0].status == "met" and head[0].measured.startswith("-0.800")
    assert tables[1].rows == [["K", "1.000", "0.900", "0.800"], ["V", "0.990", "0.700", "0.500"]]
    assert len(figures) == 1 and (tmp_path / "smollm2_pair_drift.png").is_file()


def test_raw_reuse_that_serves_misses_it_and_no_file_names_the_command(models, tmp_path):
    _, _, head = real_section.build(models, tmp_path)
    assert len(head) == 1 and head[0].status == "missing" and "realpair_eval" in head[0].command
    _commit(models, raw_hits=20)
    _, _, head = real_section.build(models, tmp_path)
    assert head[0].status == "missed"
