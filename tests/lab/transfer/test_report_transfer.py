"""The transfer report section reads a committed bench JSON and judges each target from its numbers."""

from __future__ import annotations

import json
from pathlib import Path

from kvstate.lab.provenance import Recorder, append_run
from kvstate.lab.transfer.section import CODEC, build


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


def _write(models: Path, bench: dict, *, provenance: bool = True, model_dirs: tuple[Path, ...] = ()) -> None:
    (models / CODEC).mkdir(parents=True, exist_ok=True)
    path = models / CODEC / "bench.json"
    path.unlink(missing_ok=True)
    if provenance:
        rec = Recorder(code=("transfer", "lab/transfer"), models=model_dirs, n=2, seeds=[1000])
        append_run(path, bench, rec.finish())
    else:  # a file from before provenance was recorded
        path.write_text(json.dumps(bench))


def test_targets_met_and_missed_follow_the_numbers(tmp_path: Path) -> None:
    _write(tmp_path / "m", _bench(scd_score=0.78, scd_bytes=200.0, scd_ms=10.0))
    sec = build(tmp_path / "out", tmp_path / "m")
    assert [h.met for h in sec.headline] == [True, True, True]  # premise, quality, payload
    assert all(h.source == "artifact" and h.status == "met" for h in sec.headline)
    assert "0.500 vs 0.800" in sec.headline[0].measured and "10.24x" in sec.headline[2].measured
    assert any("PATCH budget" in t.title and len(t.rows) == 2 for t in sec.tables)
    assert "raw reuse 0.500" in sec.notes[0]  # a fact that cannot be missed is a note, not a target
    assert (tmp_path / "out" / "transfer_pareto.png").stat().st_size > 0
    _write(tmp_path / "m", _bench(scd_score=0.70, scd_bytes=300.0, scd_ms=30.0))
    sec = build(tmp_path / "out", tmp_path / "m")
    assert [h.met for h in sec.headline] == [True, False, False]


def test_a_file_without_provenance_or_with_a_changed_model_is_stale(tmp_path: Path) -> None:
    _write(tmp_path / "m", _bench(scd_score=0.78, scd_bytes=200.0, scd_ms=10.0), provenance=False)
    sec = build(tmp_path / "out", tmp_path / "m")
    assert all(h.status == "stale" and h.met is None and "kvstate transfer bench" in h.measured for h in sec.headline)
    model = tmp_path / "consumer"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"weights v1")
    _write(tmp_path / "m", _bench(scd_score=0.78, scd_bytes=200.0, scd_ms=10.0), model_dirs=(model,))
    assert {h.status for h in build(tmp_path / "out", tmp_path / "m").headline} == {"met"}
    (model / "model.safetensors").write_bytes(b"weights v2")  # the consumer was retrained after the bench
    sec = build(tmp_path / "out", tmp_path / "m")
    assert {h.status for h in sec.headline} == {"stale"} and "changed since the run" in sec.headline[0].measured


def test_missing_bench_names_the_command(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    sec = build(tmp_path / "out", tmp_path)
    assert "kvstate transfer bench" in sec.intro and sec.headline[0].met is None
    assert sec.headline[0].status == "missing" and "kvstate transfer bench" in sec.headline[0].measured


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
    _write(tmp_path / "m", _bench(0.78, 200.0, 10.0))
    card = consumer_card(tmp_path / "ft", tmp_path / "base", tmp_path / "m" / CODEC / "bench.json", "kvstate train ...")
    assert "4 steps, 1.00 M tokens, 2.0 min" in card and "| 12 | 1.5 | 1.250 | 1.00 |" in card
    assert "| **mean score** | **0.800** | **0.500** |" in card and "kvstate train ..." in card
    assert "| attention q/k/v/o |" in card
