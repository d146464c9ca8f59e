"""The transfer report section reads each pair's committed bench and TTFT files and judges each target from
their numbers; a missing or stale file is marked so."""

from __future__ import annotations

import json
from pathlib import Path

from kvstate.lab.provenance import Recorder, append_run
from kvstate.lab.transfer.section import CODEC, NEAR_ALIGNED, SHIFTED, TTFT_FILE, build, pareto_front


def _row(method: str, score: float, bpt: float, ms: float, length: int = 1024) -> dict:
    return {"method": method, "length": length, "n": 2, "score": score, "score_ci": [score - 0.1, score + 0.1],
            "f1": score, "ppl": 3.0, "payload_bytes_per_token": bpt, "consumer_ms": ms, "ttft_ms": None,
            "achieved_gbit_s": None, "per_task": {f"niah_single@{length}": score}, "weak_tasks": {"qa@1024": 0.1}}


def _bench(scd_score: float, scd_bytes: float, scd_ms: float) -> dict:
    rows = [_row(m, s, b, ms, length) for length in (1024, 2048) for m, s, b, ms in (
        ("oracle", 0.8, 0, 100.0), ("raw", 0.5, 2048, 5.0), ("kivi4", 0.4, 600, 6.0), ("droidspeak", 0.7, 1800, 40.0),
        ("reuse", 0.6, scd_bytes, scd_ms), ("scd", scd_score, scd_bytes, scd_ms), ("scd_k1", 0.65, scd_bytes, scd_ms))]
    return {"results": rows, "fp16_raw_kv_bytes_per_token": 2048, "patch_layers": [0],
            "droidspeak_block": [0, 1], "ranks": {"k": 8, "v": 24, "h": 64}, "bits": 8, "reuse_map": "joint",
            "config": {"n": 2, "seed": 0, "lengths": [1024, 2048], "ppl_n": 1, "ppl_length": 1024},
            "patch_budget": [{"k": 0, "method": "reuse", "layers": []}, {"k": 1, "method": "scd_k1", "layers": [0]}]}


def _write(models: Path, bench: dict, *, provenance: bool = True, model_dirs: tuple[Path, ...] = (),
           codec: str = CODEC, name: str = "bench.json") -> None:
    (models / codec).mkdir(parents=True, exist_ok=True)
    path = models / codec / name
    path.unlink(missing_ok=True)
    if provenance:
        rec = Recorder(code=("transfer", "lab/transfer"), models=model_dirs, n=2, seeds=[1000])
        append_run(path, bench, rec.finish())
    else:  # a file from before provenance was recorded
        path.write_text(json.dumps(bench))


def test_targets_met_and_missed_follow_the_numbers(tmp_path: Path) -> None:
    _write(tmp_path / "m", _bench(scd_score=0.78, scd_bytes=200.0, scd_ms=10.0))
    sec = build(tmp_path / "out", tmp_path / "m")
    assert [h.met for h in sec.headline[:3]] == [True, True, True]  # premise, quality, payload
    assert all(h.source == "artifact" and h.status == "met" for h in sec.headline[:3])
    assert sec.headline[3].status == "missing" and "transfer_ttft.py" in sec.headline[3].measured  # no ttft.json
    assert "0.500 vs 0.800" in sec.headline[0].measured and "10.24x" in sec.headline[2].measured
    assert any("PATCH budget" in t.title and len(t.rows) == 2 for t in sec.tables)
    assert any("raw reuse 0.500" in n for n in sec.notes)  # a fact that cannot be missed is a note, not a target
    assert (tmp_path / "out" / "transfer_pareto.png").stat().st_size > 0
    _write(tmp_path / "m", _bench(scd_score=0.70, scd_bytes=300.0, scd_ms=30.0))
    sec = build(tmp_path / "out", tmp_path / "m")
    assert [h.met for h in sec.headline[:3]] == [True, False, False]


def _with_items(bench: dict, ones: dict[str, int], n: int = 40) -> dict:
    """Per-item scores on the same n items per length: method m solves the first ones[m] of them."""
    for row in bench["results"]:
        k = ones.get(row["method"], n // 2)
        row["items"] = [1.0] * k + [0.0] * (n - k)
        row["score"] = k / n
    return bench


def test_reuse_between_raw_and_scd_and_patch_monotone_are_decided_on_paired_items(tmp_path: Path) -> None:
    def rows(ones: dict[str, int]) -> dict[str, object]:
        bench = _with_items(_bench(0.78, 200.0, 10.0), ones)
        _write(tmp_path / "m", bench)
        sec = build(tmp_path / "out", tmp_path / "m")
        return {h.target.split("] ")[-1].split(" (")[0]: h for h in sec.headline
                if "REUSE alone" in h.target or "PATCH" in h.target}

    got = rows({"raw": 10, "reuse": 20, "scd": 30, "scd_k1": 31, "oracle": 32})
    assert got["REUSE alone between raw and SCD"].status == "met"  # both steps up, intervals above zero
    assert got["PATCH quality non-decreasing in k within intervals"].status == "met"
    assert "k=0 0.500, k=1 0.775" in got["PATCH quality non-decreasing in k within intervals"].measured
    got = rows({"raw": 30, "reuse": 20, "scd": 30, "scd_k1": 2, "oracle": 32})
    assert got["REUSE alone between raw and SCD"].status == "missed"  # REUSE below raw
    assert got["PATCH quality non-decreasing in k within intervals"].status == "missed"  # k = 1 below k = 0 (REUSE)
    got = rows({"raw": 20, "reuse": 20, "scd": 20, "scd_k1": 20, "oracle": 32})
    # level on every item: a tie on 40 items bounds each step within about +-0.09 (Wilson), so not decided
    assert got["REUSE alone between raw and SCD"].status == "undecided"
    assert got["PATCH quality non-decreasing in k within intervals"].status == "met"  # no step down


def test_a_file_without_provenance_or_with_a_changed_model_is_stale(tmp_path: Path) -> None:
    _write(tmp_path / "m", _bench(scd_score=0.78, scd_bytes=200.0, scd_ms=10.0), provenance=False)
    sec = build(tmp_path / "out", tmp_path / "m")
    assert all(h.status == "stale" and h.met is None and "kvstate transfer bench" in h.measured
               for h in sec.headline[:3])
    model = tmp_path / "consumer"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"weights v1")
    _write(tmp_path / "m", _bench(scd_score=0.78, scd_bytes=200.0, scd_ms=10.0), model_dirs=(model,))
    assert {h.status for h in build(tmp_path / "out", tmp_path / "m").headline[:3]} == {"met"}
    (model / "model.safetensors").write_bytes(b"weights v2")  # the consumer was retrained after the bench
    sec = build(tmp_path / "out", tmp_path / "m")
    assert {h.status for h in sec.headline[:3]} == {"stale"} and "changed since the run" in sec.headline[0].measured


def test_missing_bench_names_the_command(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    sec = build(tmp_path / "out", tmp_path)
    assert "kvstate transfer bench" in sec.intro and sec.headline[0].met is None
    assert sec.headline[0].status == "missing" and "kvstate transfer bench" in sec.headline[0].measured
    (tmp_path / CODEC).mkdir()  # a codec without either result file: both marked missing with their commands
    sec = build(tmp_path / "out", tmp_path)
    assert [h.status for h in sec.headline] == ["missing", "missing"]
    assert "kvstate transfer bench" in sec.headline[0].measured and "transfer_ttft.py" in sec.headline[1].measured
    assert "--out models/codec-ref-attn-ft/ttft.json" in sec.headline[1].measured
    assert any("ref-attn-ft2" in n and "no codec" in n for n in sec.notes)  # the shifted pair is listed, not read


def test_consumer_card_is_generated_from_the_run(tmp_path: Path) -> None:
    from kvstate.lab.transfer.card import consumer_card
    from kvstate.models.tiny import tiny_model

    cfg = {"max_length": 1024, "lr": 0.002, "warmup_steps": 30, "decay_fraction": 0.15, "answer_share": 0.6,
           "task_mix": {"niah_multivalue": 3, "qa": 2}}
    point = {"step": 12, "minutes": 1.5, "loss": 1.25, "exact": {"niah_single": 1.0}, "first_token": {"niah_multivalue": 0.5}}
    for name, seed, state in (("base", 0, {"step": 10, "tokens": 100, "seconds": 60.0, "curve": [], "config": cfg}),
                              ("ft", 1, {"step": 14, "tokens": 1_000_100, "seconds": 180.0, "curve": [point], "config": cfg})):
        tiny_model("qwen3", seed=seed).save_pretrained(tmp_path / name)
        (tmp_path / name / "training_state.json").write_text(json.dumps(state))
    bench = _bench(0.78, 200.0, 10.0)
    for row in bench["results"]:  # one row per method and length: the card shows every length's cells
        if row["method"] == "oracle" and row["length"] == 2048:
            row["score"], row["per_task"] = 0.6, {"niah_single@2048": 0.6}
    _write(tmp_path / "m", bench)
    card = consumer_card(tmp_path / "ft", tmp_path / "base", tmp_path / "m" / CODEC / "bench.json", "kvstate train ...")
    assert "4 steps, 1.00 M tokens, 2.0 min" in card and "| 12 | 1.5 | 1.250 | 1.00 |" in card
    assert "| niah_single@1024 | 0.800 | 0.500 |" in card and "| niah_single@2048 | 0.600 | 0.500 |" in card
    assert "| **mean score** (every length) | **0.700** | **0.500** |" in card and "kvstate train ..." in card
    assert "| attention q/k/v/o |" in card and "Trained in" not in card  # one part: no parts list
    state = json.loads((tmp_path / "ft" / "training_state.json").read_text())
    state["commands"] = [{"command": "kvstate train --out a", "resume": "base", "from_step": 10},
                         {"command": "kvstate train --out b", "resume": "a", "from_step": 12}]
    (tmp_path / "ft" / "training_state.json").write_text(json.dumps(state))
    card = consumer_card(tmp_path / "ft", tmp_path / "base", None, "kvstate train ...")
    assert "Trained in 2 parts" in card and "1. from step 10 (`base`): `kvstate train --out a`" in card
    assert "2. from step 12 (`a`): `kvstate train --out b`" in card


def _ttft_row(method: str, length: int, ms: dict[str, tuple[float, float]], spread: float = 0.1) -> dict:
    """A benchmarks/transfer_ttft.py row: per rate key (cold, warm) medians and a min / max spread."""
    row = {"method": method, "length": length, "n": 5, "ttft_ms": {}, "ttft_range_ms": {}, "achieved_gbit_s": {}}
    for key, (cold, warm) in ms.items():
        row["ttft_ms"][key] = {"cold": cold, "warm": warm}
        row["ttft_range_ms"][key] = {m: [v * (1 - spread), v * (1 + spread)] for m, v in (("cold", cold), ("warm", warm))}
        row["achieved_gbit_s"][key] = {"0.1": 0.098, "1": 0.97}[key]
    if method != "oracle":
        row["payload_bytes_per_token"], row["first_token_agrees"] = 100.0, 1.0
    return row


def _ttft(scd_warm_8k: float, spread: float = 0.1) -> dict:
    """Oracle 1000 ms at 8K; raw slow on the slow link, fast on the fast one; SCD's warm time as given."""
    ms = {"oracle": {"0.1": (1000.0, 1000.0), "1": (1000.0, 1000.0)},
          "raw": {"0.1": (3000.0, 2500.0), "1": (700.0, 200.0)},
          "kivi4": {"0.1": (1200.0, 800.0), "1": (600.0, 150.0)},
          "droidspeak": {"0.1": (3500.0, 3000.0), "1": (900.0, 400.0)},
          "scd": {"0.1": (900.0, 2 * scd_warm_8k), "1": (650.0, scd_warm_8k)}}
    rows = [_ttft_row(m, length, {k: (c * length / 8192, w * length / 8192) for k, (c, w) in v.items()}, spread)
            for m, v in ms.items() for length in (1024, 8192)]
    return {"rows": rows, "skipped": {"10": "rate refused by the kernel"}, "config": {"repeats": 5},
            "links": {"0.1": {"rate_gbit": 0.1, "achieved_gbit_s": 0.098}, "1": {"rate_gbit": 1.0, "achieved_gbit_s": 0.97}}}


def test_ttft_table_pareto_and_targets_from_the_ttft_file(tmp_path: Path) -> None:
    _write(tmp_path / "m", _bench(scd_score=0.78, scd_bytes=200.0, scd_ms=10.0))
    _write(tmp_path / "m", _ttft(scd_warm_8k=300.0), name=TTFT_FILE)
    sec = build(tmp_path / "out", tmp_path / "m")
    warm, front = sec.headline[3], sec.headline[4]
    assert warm.status == "met" and "3.33x" in warm.measured  # 1000 / 300, and 900 / 330 >= 2 over the spread
    # at 0.1 Gbit/s SCD (cold 900, 0.78) beats raw / kivi4 / droidspeak; at 1 Gbit/s kivi4 is faster cold but worse
    assert front.status == "met" and "0.1 Gbit/s cold" in front.measured and "1 Gbit/s warm" in front.measured
    table = next(t for t in sec.tables if t.title.startswith("[near-aligned] Time to first token"))
    assert len(table.rows) == 5 * 2 * 2 and "achieved Gbit/s" in table.columns
    row = next(r for r in table.rows if r[:3] == ["scd", 8192, "1"])
    assert row[3] == 0.97 and row[5].startswith("300.0 [270.0, 330.0]")
    assert any("10 Gbit/s not measured" in n and "refused" in n for n in sec.notes)
    assert any(f.filename == "transfer_ttft_pareto.png" for f in sec.figures)
    assert (tmp_path / "out" / "transfer_ttft_pareto.png").stat().st_size > 0
    pareto = next(t for t in sec.tables if "Pareto front" in t.title)
    assert any(r[1] == "cold" and r[2].startswith("scd") for r in pareto.rows)
    _write(tmp_path / "m", _ttft(scd_warm_8k=700.0), name=TTFT_FILE)  # 1.43x; 1100 / 630 < 2 at the best repeat
    assert build(tmp_path / "out", tmp_path / "m").headline[3].status == "missed"
    _write(tmp_path / "m", _ttft(scd_warm_8k=480.0, spread=0.3), name=TTFT_FILE)  # 2.08x, 1.2x-3.5x over repeats
    assert build(tmp_path / "out", tmp_path / "m").headline[3].status == "undecided"


def test_ttft_without_the_target_cell_or_with_stale_provenance_is_marked(tmp_path: Path) -> None:
    _write(tmp_path / "m", _bench(scd_score=0.78, scd_bytes=200.0, scd_ms=10.0))
    ttft = _ttft(scd_warm_8k=300.0)
    ttft["rows"] = [r for r in ttft["rows"] if r["length"] == 1024]
    _write(tmp_path / "m", ttft, name=TTFT_FILE)
    sec = build(tmp_path / "out", tmp_path / "m")
    assert sec.headline[3].status == "missing" and "8192 tokens" in sec.headline[3].measured
    _write(tmp_path / "m", _ttft(scd_warm_8k=300.0), name=TTFT_FILE, provenance=False)
    sec = build(tmp_path / "out", tmp_path / "m")
    assert {h.status for h in sec.headline[3:]} == {"stale"}
    assert all("transfer_ttft.py" in h.measured for h in sec.headline[3:])


def test_both_pairs_side_by_side_when_both_exist(tmp_path: Path) -> None:
    near = _bench(scd_score=0.78, scd_bytes=200.0, scd_ms=10.0)
    shifted = _bench(scd_score=0.78, scd_bytes=200.0, scd_ms=10.0)
    for r in shifted["results"]:
        if r["method"] == "raw":
            r["score"] = 0.2
    _write(tmp_path / "m", near)
    _write(tmp_path / "m", shifted, codec=SHIFTED.codec)
    sec = build(tmp_path / "out", tmp_path / "m")
    side = sec.tables[0]
    assert side.title.startswith("Pairs side by side") and [r[0] for r in side.rows] == ["shifted", "near-aligned"]
    assert side.rows[0][5] == 0.25 and side.rows[1][5] == 0.625  # raw / oracle per pair
    assert any(t.title.startswith("[shifted] Methods") for t in sec.tables)
    assert any(t.title.startswith("[near-aligned] Methods") for t in sec.tables)
    assert sec.headline[0].target.startswith("[shifted] premise") and sec.headline[0].met
    assert "codec-ref-attn-ft2" in sec.headline[0].command and NEAR_ALIGNED.codec in sec.headline[5].command


def test_drift_table_shows_the_in_context_patch_gain_when_recorded(tmp_path: Path) -> None:
    bench = _bench(scd_score=0.78, scd_bytes=200.0, scd_ms=10.0)
    drift = {k: [0.1, 0.2] for k in ("raw_drift_k", "raw_drift_v", "reuse_err_k", "reuse_err_v", "patch_err_k",
                                     "patch_err_v", "impact_raw", "impact_reuse", "impact_patch")}
    bench["drift"] = drift
    _write(tmp_path / "m", bench)
    table = next(t for t in build(tmp_path / "out", tmp_path / "m").tables if "Per layer" in t.title)
    assert len(table.columns) == 10 and len(table.rows) == 2
    bench["drift"] = {**drift, "patch_in_context": [0.5, 0.3], "patch_gain": [0.0, 0.2]}
    _write(tmp_path / "m", bench)
    table = next(t for t in build(tmp_path / "out", tmp_path / "m").tables if "Per layer" in t.title)
    assert table.columns[-2:] == ["KL PATCH (REUSE elsewhere)", "gain"] and table.rows[1][-2:] == [0.3, 0.2]


def test_pareto_front_keeps_the_undominated() -> None:
    pts = {"a": (1.0, 0.5), "b": (2.0, 0.9), "c": (2.0, 0.4), "d": (3.0, 0.9), "e": (0.5, 0.5)}
    assert pareto_front(pts) == ["e", "b"]


def test_codec_card_shows_the_in_context_patch_gain(tmp_path: Path) -> None:
    from kvstate.lab.transfer.card import codec_card

    per = {k: [0.1, 0.2] for k in ("raw_drift_k", "raw_drift_v", "reuse_err_k", "reuse_err_v", "patch_err_k",
                                   "patch_err_v", "impact_raw", "impact_reuse", "impact_patch")}
    cal = {**per, "kl_all_layers": {"raw": 0.9, "reuse": 0.6, "patch_all": 0.4}, "patch_gain": [0.0, 0.19]}
    m = {"calibration": cal, "geometry": {"n_layers": 2, "n_kv_heads": 2, "head_dim": 16}, "rank_k": 4, "rank_v": 8,
         "rank_h": 16, "bits": 8, "patch_layers": [1], "producer_fingerprint": "a" * 64, "consumer_fingerprint": "b" * 64}
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    assert "REUSE at every other layer" not in codec_card(tmp_path, "kvstate transfer calibrate ...")  # older codec
    cal["patch_in_context"] = [0.7, 0.41]
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    card = codec_card(tmp_path, "kvstate transfer calibrate ...")
    assert "layer 0 KL 0.7000 gain 0.0000, layer 1 KL 0.4100 gain 0.1900" in card and "REUSE everywhere, 0.6000" in card
