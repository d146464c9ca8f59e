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
    assert head[0].target == real_section.CLAIM and head[0].status == "missing"  # the claim leads, its files absent
    head = head[1:]
    assert [r[:2] for r in tables[0].rows] == [[m, "niah_single"] for m in METHODS]
    assert tables[0].rows[1][2].startswith("0.20 [") and tables[0].rows[1][3] == "1100"
    assert head[0].status == "met" and head[0].measured.startswith("-0.800") and head[1].status == "missing"
    assert tables[1].rows == [["K", "1.000", "0.900", "0.800"], ["V", "0.990", "0.700", "0.500"]]
    assert len(figures) == 1 and (tmp_path / "smollm2_pair_drift.png").is_file()


def test_raw_reuse_that_serves_misses_it_and_no_file_names_the_command(models, tmp_path):
    _, _, head = real_section.build(models, tmp_path)
    assert [h.status for h in head] == ["missing"] * 6 and "realpair_bench" in head[0].command  # the claim's
    head = head[1:]
    assert "realpair_eval" in head[0].command and "realpair_ppl" in head[4].command
    assert "--task niah_single" in head[1].command and "--task niah_multikey" in head[2].command
    _commit(models, raw_hits=20)
    _, _, head = real_section.build(models, tmp_path)
    assert head[1].status == "missed"


def _commit_bench(models: Path, raw_hits: int, raw_error: float, n: int = 40, share: float = 0.5,
                  task: str = "niah_single") -> None:
    from kvstate.lab.transfer import realpair_bench as B

    e = B.experiment(Path("a"), Path("b"), Path("c"), ["raw", "droidspeak@0.25"], ("niah_single",), (1024,), n,
                     1101, 48, {"droidspeak@0.25": "6:13"})
    e = X.Experiment(**{**e.__dict__, "code": ("lab/scoring.py",), "models": ()})

    def about(err: float, rec: int) -> dict:
        return {"bytes_per_token": 100.0, "bf16_share": share, "recomputed": rec, "flops_share": rec / 30, "seconds": 1.0,
                "gate": {"error": err, "nll": 1.0, "layer_errors": [err]}}

    def item(it: X.Item) -> X.ItemResult:
        return X.ItemResult({B.ORACLE: 1.0, "raw": float(it.index < raw_hits), "droidspeak@0.25": 1.0},
                            {"methods": {"raw": about(raw_error, 0), "droidspeak@0.25": about(0.3, 7)}})

    recs: list = []

    def keep(it: X.Item) -> X.ItemResult:
        got = item(it)
        recs.append({"scores": dict(got.scores), "extra": dict(got.extra)})
        return got

    X.run_items(e, keep, out=models / real_section.BENCH_FILES[task],
                appendix=lambda _j: {"methods": B.summary(recs), "gate": B.gate_summary(recs, 0.1)})


def test_the_bench_reads_as_a_table_with_its_decisions_and_the_gates_rates(models, tmp_path):
    _commit_bench(models, raw_hits=25, raw_error=0.05, n=100)  # raw wrong on 75 of 100 items and the gate serves it
    tables, figures, head = real_section.build(models, tmp_path)
    bench = tables[0]
    assert [r[:2] for r in bench.rows] == [[m, "niah_single"] for m in ("oracle", "raw", "droidspeak@0.25")]
    raw = bench.rows[1]
    assert raw[2].startswith("0.25 [") and raw[3].startswith("-0.75 [") and raw[4] == "0.50" and raw[5] == "0"
    assert raw[6] == "0.050" and raw[7] == "0.25 (100/100 served)"
    assert bench.rows[2][7] == "1.00 (0/100 served)" and bench.rows[0][5] == "30 (all)"
    labels = [h.target for h in head]
    assert sum("0.95x the oracle on the solved" in t for t in labels) == 2  # and the multikey file missing
    by = {h.target.split(" ")[0]: h for h in head if "0.95x the oracle on the solved" in h.target}
    assert by["raw"].status == "missed" and by["droidspeak@0.25"].status == "met"
    gate = [h for h in head if h.target.startswith("the gate")]
    assert len(gate) == 1 and gate[0].status == "missed" and gate[0].measured.startswith("0.375 [")  # 75 of 200
    assert (tmp_path / "smollm2_pair_bench_niah_single.png").is_file() and len(figures) == 1  # no premise file here


def test_a_gate_that_refuses_every_bad_transfer_meets_its_target(models, tmp_path):
    _commit_bench(models, raw_hits=10, raw_error=0.4, n=100)  # the gate refuses raw and DroidSpeak (right on all)
    _, _, head = real_section.build(models, tmp_path)
    gate = next(h for h in head if h.target.startswith("the gate"))
    assert gate.status == "met" and "false rejects 0.550" in gate.measured  # 10 raw + 100 DroidSpeak of 200
    _commit_bench(models, raw_hits=10, raw_error=0.4, n=40)  # no bad transfer served, but 80 pairs cannot show <= 2%
    _, _, head = real_section.build(models, tmp_path)
    assert next(h for h in head if h.target.startswith("the gate")).status == "undecided"


def _ttft_file(models: Path, warm: float, cold: float) -> None:
    from kvstate.lab.provenance import Recorder, append_run

    def row(m: str, c: float, w: float) -> dict:
        return {"method": m, "length": 8128, "n": 5, "ttft_ms": {"1": {"cold": c, "warm": w}},
                "ttft_range_ms": {"1": {"cold": [c * 0.95, c * 1.05], "warm": [w * 0.95, w * 1.05]}},
                "achieved_gbit_s": {"1": 0.98}, "payload_bytes_per_token": 23040.0}

    path = models / real_section.TTFT_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    rec = Recorder(code=("lab/transfer/real_section.py",), models=(), n=5, seeds=[1102])
    append_run(path, {"rows": [row("oracle", 60000.0, 60000.0), row("raw", cold, warm)]}, rec.finish())


def test_the_real_pairs_ttft_is_a_table_with_a_warm_and_a_cold_row_per_method(models, tmp_path):
    _ttft_file(models, warm=3000.0, cold=70000.0)
    tables, _, head = real_section.build(models, tmp_path)
    assert any("Time to first token" in t.title for t in tables)
    rows = {h.target.split(" TTFT")[0]: h for h in head if " TTFT " in h.target}
    assert rows["raw warm"].status == "met" and rows["raw warm"].measured.startswith("20.00x")
    assert rows["raw cold"].status == "missed"  # 70 s against the oracle's 60 s, the repeats apart
    _ttft_file(models, warm=40000.0, cold=59000.0)
    _, _, head = real_section.build(models, tmp_path)
    rows = {h.target.split(" TTFT")[0]: h for h in head if " TTFT " in h.target}
    assert rows["raw warm"].status == "missed" and rows["raw cold"].status == "undecided"


def _commit_ppl(models: Path, factor: float, n: int = 12) -> None:
    from kvstate.lab.transfer import realpair_ppl as R

    e = R.experiment(Path("a"), Path("b"), Path("c"), ["raw"], n, 1102, "some text", {})
    e = X.Experiment(**{**e.__dict__, "code": ("lab/scoring.py",), "models": ()})
    recs: dict = {}

    def item(it: X.Item) -> X.ItemResult:
        nll = 100.0 + 7 * (it.index % 5)
        extra = {"methods": {R.ORACLE: {"nll": nll, "tokens": 95, "first_divergence": 64},
                             R.FLOOR: {"nll": nll + 0.01, "tokens": 95, "first_divergence": 20, "bf16_share": 1.0,
                                       "recomputed": 30},
                             "raw": {"nll": nll * factor + 0.3 * (it.index % 3), "tokens": 95, "first_divergence": 9,
                                     "bf16_share": 1.0, "recomputed": 0}}}
        recs[it.unit] = {"extra": extra}
        return X.ItemResult({R.ORACLE: 1.0, R.FLOOR: 0.5, "raw": 0.25}, extra)

    X.run_items(e, item, out=models / real_section.PPL_FILE,
                appendix=lambda _j: R.summary(e.methods, [recs[it.unit] for it in X.items(e)], 1102))


def test_held_out_perplexity_under_transfer_reads_as_a_table_and_a_decided_row_per_method(models, tmp_path):
    _commit_ppl(models, factor=1.2)
    tables, _, head = real_section.build(models, tmp_path)
    table = next(t for t in tables if "held-out perplexity" in t.title)
    assert [r[0] for r in table.rows] == ["oracle", "own_bf16", "raw"] and table.rows[2][2].startswith("1.2")
    assert table.rows[2][3].startswith("0.25 [") and table.rows[2][4] == "9.0" and table.rows[0][6] == "30 (all)"
    row = head[-1]  # one decided row: the floor is shown, never decided
    assert sum("held-out perplexity" in h.target and h.target != real_section.CLAIM for h in head) == 1
    assert row.status == "missed" and "raw: held-out perplexity" in row.target
    _commit_ppl(models, factor=1.0)
    assert real_section.build(models, tmp_path)[2][-1].status == "met"


def test_the_claim_is_met_by_a_transfer_inside_the_budget_that_meets_every_leg_and_missed_otherwise(models, tmp_path):
    def claim():
        return real_section.claim(models)[0]

    for task in real_section.BENCH_FILES:  # raw ships 0.2 of bf16 and computes nothing: inside the budget
        _commit_bench(models, raw_hits=100, raw_error=0.05, n=100, share=0.2, task=task)
    assert claim().status == "missing"  # the perplexity file is not there yet
    _commit_ppl(models, factor=1.0)
    got = claim()
    assert got.status == "met" and "raw (0% FLOPs, 0.20 of bf16): niah_single met, niah_multikey met, perplexity met" in got.measured
    assert got.measured.startswith("droidspeak@0.25 (23% FLOPs, 0.20 of bf16): niah_single met, niah_multikey met;")
    _commit_ppl(models, factor=1.2)  # raw's perplexity misses; DroidSpeak's was never measured: not decided
    assert claim().status == "undecided" and "perplexity missed" in claim().measured
    _commit_bench(models, raw_hits=100, raw_error=0.05, n=100, share=0.3)  # one file's bytes put both outside
    _commit_ppl(models, factor=1.0)
    got = claim()
    assert got.status == "missed" and got.measured.startswith("no method fits the budget")


def test_the_perplexity_run_has_a_figure_of_ratio_against_agreement_and_none_without_its_file(models, tmp_path):
    assert real_section.ppl_figures(models, tmp_path) == []
    _commit_ppl(models, factor=1.2)
    figures = real_section.ppl_figures(models, tmp_path)
    assert [f.filename for f in figures] == ["smollm2_pair_ppl.png"] and (tmp_path / "smollm2_pair_ppl.png").stat().st_size > 0
    assert "smollm2_pair_ppl.png" in [f.filename for f in real_section.build(models, tmp_path)[1]]
