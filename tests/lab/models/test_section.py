"""The real-model report section reads committed result files only: the reference table with its intervals and
perplexity, the exchange with its decision, and a missing file named with the command that writes it."""

from __future__ import annotations

import json
from pathlib import Path

from kvstate.lab import experiment as X
from kvstate.lab.models import section


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
                                                               "serve_exchange.json", "serve_peer.json"]
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
    assert all(r.status == "missing" for r in s.headline) and len(s.headline) == 5
    assert any("--length 4096 --n 100" in r.command for r in s.headline)
    assert json.loads(json.dumps(s.summary)) == s.summary and Path(tmp_path).is_dir()


def test_the_exchange_is_shown_with_its_decision(models, tmp_path):
    from kvstate.lab.cli_output import write_results

    e = X.Experiment(axis="position", name="serve-real-exchange", methods=("cold", "warm"), seeds=(1100,),
                     tasks=("chat-2k-document",), lengths=(2048,), repeats=5, kind="timing",
                     targets=(X.Target("cached TTFT p50 <= 1/2 uncached", "warm", "ratio", 0.5,
                                       higher_is_better=False, against="cold"),),
                     code=("lab/scoring.py",))
    doc = X.run(e, lambda c: X.Measurement([8.0 + 0.1 * c.repeat if c.method == "cold" else 0.3 + 0.01 * c.repeat]))
    turns = [{"question": "What is the special magic number for Wen?", "reply": "It is 2103556.",
              "cached_tokens": 0, "prompt_tokens": 1683, "ttft_s": 7.0},
             {"question": "And for Priya?", "reply": "It is 4209644.", "cached_tokens": 1714,
              "prompt_tokens": 1736, "ttft_s": 0.35}]
    result = {k: doc[k] for k in ("experiment", "rows", "pooled", "decisions")} | {"exchange": turns}
    write_results(models / section.RESULTS / "serve_exchange.json", result, doc["provenance"], overwrite=False)
    s = section.build(tmp_path, models)
    row = next(r for r in s.headline if r.technique == "real model: kvstate serve")
    assert row.status == "met" and row.measured.startswith("0.04×") and "320 vs 8200 ms" in row.measured
    shown = next(t for t in s.tables if t.title.startswith("A real exchange"))
    assert shown.rows[1] == ["And for Priya?", "It is 4209644.", "1,714 / 1,736", "350"]
