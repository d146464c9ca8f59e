"""The depth section leads with the real model: the xKV run reads as a table with the bytes each row held, its
pre-registered target becomes a headline row decided on the paired interval; no file names the command."""

from __future__ import annotations

from pathlib import Path

from kvstate.lab import experiment as X
from kvstate.lab.depth import real_section
from kvstate.lab.depth.xkv_real import experiment


def _commit(models: Path, hits: int, n: int = 20) -> None:
    e = experiment(Path("m"), ((4, 0.5),), ("niah_single",), (1024,), n, 1100, 48)
    e = X.Experiment(**{**e.__dict__, "code": ("lab/scoring.py",), "models": ()})

    def item(it: X.Item) -> X.ItemResult:
        return X.ItemResult({"full": 1.0, "xkv-g4@0.5": float(it.index < hits)},
                            {"held": {"xkv-g4@0.5": {"bf16": 0.499, "ranks": [200]}}})

    X.run_items(e, item, out=models / real_section.FILE)


def test_a_collapse_misses_the_target_and_the_bytes_are_shown(models):
    _commit(models, hits=10)
    tables, head = real_section.build(models)
    assert [r[:2] for r in tables[0].rows] == [["full", "niah_single"], ["xkv-g4@0.5", "niah_single"]]
    assert tables[0].rows[1][3] == "0.499" and tables[0].rows[0][3] == "1" and tables[0].rows[1][4] == "1100"
    assert len(head) == 2 and head[0].status == "missed" and head[0].measured.startswith("-0.500")
    assert head[1].status == "missed" and "xkv-g4@0.5 niah_single 0.50 vs full 1.00" in head[1].measured


def test_no_file_names_the_command_and_a_kept_retrieval_meets_it(models):
    _, head = real_section.build(models)
    assert len(head) == 1 and head[0].status == "missing" and "xkv_real" in head[0].command
    _commit(models, hits=20)  # equal on 20 items: the interval still reaches below -0.05
    assert real_section.build(models)[1][0].status == "undecided"
    _commit(models, hits=300, n=300)
    assert [h.status for h in real_section.build(models)[1]] == ["met", "met"]
