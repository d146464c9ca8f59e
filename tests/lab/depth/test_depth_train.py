"""Training with stochastic KV routing: depth_train on a tiny start model, and 2-process DDP under torchrun."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvstate.depth.patterns import PatternError
from kvstate.errors import KVStateError
from kvstate.lab.depth import rcla_section, real_section
from kvstate.lab.depth.train import DepthTrainConfig, depth_train
from kvstate.lab.training.train import load_state
from tests.lab.depth.conftest import FAST


def test_depth_train_records_routing_and_resumes(start, tmp_path):
    out = tmp_path / "rcla"
    state = depth_train(start, out, DepthTrainConfig(p=0.5, length=64, tokens=5 * 256), overrides=FAST,
                        progress=False, log=lambda *_: None)
    assert state["step"] == 2 + 5 and load_state(out)["depth"]["p"] == 0.5
    assert sum(load_state(out)["depth"]["parts"][0]["draw_counts"].values()) == 5
    again = depth_train(start, out, DepthTrainConfig(p=0.5, length=64, tokens=3 * 256), resume=True, overrides=FAST,
                        progress=False, log=lambda *_: None)
    saved = load_state(out)
    assert again["step"] == 10 and [p["to_step"] for p in saved["depth"]["parts"]] == [7, 10]
    spec = depth_train(start, tmp_path / "cla2", DepthTrainConfig(pattern="0_0_2_2", length=64, tokens=256),
                       overrides=FAST, progress=False, log=lambda *_: None)
    assert spec["depth"]["pattern"] == "0_0_2_2" and spec["depth"]["p"] is None


def test_depth_train_bad_input(start, tmp_path):
    with pytest.raises(PatternError, match="p"):
        DepthTrainConfig(p=1.5, tokens=10)
    with pytest.raises(KVStateError, match="--minutes M or --tokens N"):
        DepthTrainConfig(p=0.5)
    with pytest.raises(PatternError, match="layer 1"):
        depth_train(start, tmp_path / "x", DepthTrainConfig(pattern="0_2_2_2", length=64, tokens=256),
                    overrides=FAST, progress=False, log=lambda *_: None)


WORKER = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import torch, torch.distributed as dist
    import kvstate.lab.depth.train as T

    seen = {}
    factory = T._routing_factory
    def spy(*args):  # keep each rank's in-memory model to compare weights across ranks
        f = factory(*args)
        def wrap(model):
            seen["model"] = model
            ctx = f(model)
            wrap.routing = getattr(f, "routing", None)
            return ctx
        return wrap
    T._routing_factory = spy
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    state = T.depth_train(sys.argv[1], sys.argv[2], T.DepthTrainConfig(p=0.5, length=64, tokens=30 * 256),
                          overrides=json.loads(sys.argv[3]), progress=False, log=lambda *_: None)
    flat = torch.cat([p.detach().flatten() for p in seen["model"].parameters()])
    gathered = [torch.zeros_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    dist.destroy_process_group()
    # one file per rank: two processes printing to one pipe can interleave their lines
    Path(sys.argv[2] + f".result-{rank}.json").write_text(json.dumps({
        "rank": rank, "draws": state["depth"]["parts"][-1]["draw_counts"],
        "curve": [c["loss"] for c in state["curve"]], "sync": float((gathered[0] - gathered[1]).abs().max())}))
""")


def test_two_process_ddp_loss_falls_and_ranks_stay_in_sync(start, tmp_path):
    """torchrun, gloo, 2 CPU processes: each rank draws its own routes; weights stay identical."""
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3] / "src"), "OMP_NUM_THREADS": "1"}
    out = tmp_path / "ddp"
    for attempt in range(2):
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                               str(worker), str(start), str(out), json.dumps(FAST)],
                              capture_output=True, text=True, env=env, timeout=300)
        # seen once in ~10 clean runs: a worker aborts in gloo's C++ teardown ("terminate called without an
        # active exception", SIGABRT) after training; that one failure is retried once, any other fails at once
        if proc.returncode == 0 or "terminate called without an active exception" not in proc.stderr or attempt:
            break
        for stale in tmp_path.glob("ddp*"):
            shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("ddp.result-*.json"))]
    assert sorted(r["rank"] for r in results) == [0, 1]
    assert results[0]["draws"] != results[1]["draws"]  # each rank draws its own routes
    curve = next(r["curve"] for r in results if r["rank"] == 0)
    assert curve[-1] < curve[0], curve  # the loss falls
    assert all(r["sync"] == 0.0 for r in results)  # ranks hold identical weights (DDP all-reduced every step)


def test_evaluate_sharing_shape_and_measured_bytes(start):
    from kvstate.lab.depth.evaluate import evaluate_sharing

    res = evaluate_sharing(start, [1, 0.5, 0.25], "keep", n=1, seed=0, tasks=["niah_single"], lengths=[256],
                           ppl_length=128, ppl_texts=3)
    assert set(res) == {"model", "n", "seed", "tasks", "lengths", "ppl_texts", "ppl_length", "results",
                        "experiment", "rows", "pooled", "decisions", "provenance"}  # the experiment loop's own keys
    assert [r["pattern"] for r in res["results"]] == ["0_1_2_3", "0_0_2_2", "0_0_0_0"]
    for r in res["results"]:
        assert set(r) == {"keep", "pattern", "ppl", "ppl_ci", "score", "score_ci", "kv_bytes_per_token",
                          "peak_bytes", "decode_tok_s", "items", "tasks", "excluded_tasks", "cells", "all_items",
                          "text_nll", "family",
                          "family_patterns", "mean_score",
                          "worst_score", "worst_score_ci", "worst_pattern"}
        assert r["family"] == "undeclared" and list(r["family_patterns"]) == [r["pattern"]]
        assert r["worst_score"] == r["score"] == r["mean_score"] and r["worst_pattern"] == r["pattern"]
        assert r["kv_bytes_per_token"] == r["keep"] * 4 * 2 * 2 * 16 * 4  # layers x K,V x kv heads x head_dim x fp32
        assert r["ppl_ci"][0] <= r["ppl"] <= r["ppl_ci"][1] and r["peak_bytes"] > 0
        # the start model's full cache does not solve the one cell: nothing is pooled, the cell is shown excluded
        assert r["score"] is None and r["score_ci"] is None and r["items"] == [] and r["tasks"] == []
        assert r["excluded_tasks"] == {"niah_single@256": 0.0} and r["cells"] == ["niah_single@256"]
        assert r["all_items"] == [0.0]  # every cell kept, so rows of two models can pair on the cells both solve
        nll, tok = zip(*r["text_nll"], strict=True)
        assert len(nll) == 3 and abs(math.exp(sum(nll) / sum(tok)) - r["ppl"]) < 1e-3 * r["ppl"]
    assert [t for _, t in res["results"][0]["text_nll"]] == [t for _, t in res["results"][2]["text_nll"]]
    assert res["pooled"]["reference"] == "start:1/0_1_2_3" and res["experiment"]["axis"] == "depth"
    with pytest.raises(PatternError, match="not a whole number"):
        evaluate_sharing(start, [0.3], "keep", n=1)


def test_cli_eval_rejects_unrealisable_keep_and_card_needs_a_depth_run(start, tmp_path):
    from typer.testing import CliRunner

    from kvstate.cli import app

    r = CliRunner().invoke(app, ["depth", "eval", "--model", str(start), "--keep", "1,0.3"])
    assert r.exit_code != 0 and "0.3" in str(r.exception)
    r = CliRunner().invoke(app, ["depth", "card", "--model", str(start)])
    assert r.exit_code != 0 and "not a depth run" in str(r.exception)


def test_card_and_report_section_read_the_committed_files(start, tmp_path):
    from kvstate.lab.depth.card import card_text
    from kvstate.lab.depth.section import build

    run = tmp_path / "models" / "ref-attn-rcla"
    depth_train(start, run, DepthTrainConfig(p=0.5, length=64, tokens=2 * 256), overrides=FAST, progress=False,
                log=lambda *_: None)
    def rows(ppl, score, keeps=((1, "0_1_2_3"), (0.5, "0_0_2_2"), (0.25, "0_0_0_0"))):
        out = []
        for i, (k, p) in enumerate(keeps):
            hits = round(score[i] * 100)  # 100 paired items, the first `hits` solved
            nll = [[math.log(ppl[i]) * t, t] for t in (100, 200, 300, 400)]  # every text at the row's perplexity
            out.append({"keep": k, "pattern": p, "ppl": ppl[i], "ppl_ci": [ppl[i] * 0.99, ppl[i] * 1.01],
                        "score": score[i], "score_ci": [score[i] - 0.05, score[i] + 0.05],
                        "kv_bytes_per_token": 4096 * k, "decode_tok_s": 10.0, "items": [1.0] * hits + [0.0] * (100 - hits),
                        "text_nll": nll})
        return out

    files = {"ref-attn-rcla": rows([10.0, 10.2, 40.0], [0.95, 0.93, 0.2]),
             "ref-attn-norouting": rows([10.01, 30.0, 60.0], [0.96, 0.1, 0.0]),
             "ref-attn-cla2": rows([20.0, 10.1, 50.0], [0.1, 0.95, 0.0]), "ref-attn": rows([9.8, 50.0, 90.0], [0.96, 0.0, 0.0]),
             "ref-attn-kv1": rows([10.5, 30.0, 80.0], [0.80, 0.1, 0.0])}
    from kvstate.lab.depth.cli import EVAL_CODE
    from kvstate.lab.provenance import Recorder, append_run

    for name, res in files.items():  # files from before provenance was recorded: every row is stale
        (tmp_path / "models" / name).mkdir(parents=True, exist_ok=True)
        (tmp_path / "models" / name / "depth_eval.json").write_text(json.dumps({"model": name, "results": res}))
    stale = build(tmp_path, tmp_path / "models")
    # rows from before families were scored: the worst-pattern targets are missing, every other row stale
    worst = {h.target: h.status for h in stale.headline if "worst pattern" in h.target
             and h.technique != rcla_section.WHERE}
    assert len(worst) == 2 and set(worst.values()) == {"missing"}
    headline = [h for h in stale.headline if h.technique == rcla_section.WHERE]  # the real model's: first, missing
    assert stale.headline[:4] == headline and [h.status for h in headline] == ["missing"] * 4
    decode = [h for h in stale.headline if "decode through model.generate" in h.target]
    # no depth_decode.json in this tree: the real model's row and the reference model's, both missing
    assert [h.status for h in decode] == ["missing", "missing"] and "smollm2" in decode[0].command
    real = [h for h in stale.headline if h.technique == real_section.WHERE]  # the real model's part: its own test
    assert [h.status for h in real] == ["missing"]
    assert {h.status for h in stale.headline if h.target not in worst and h not in decode + real + headline} == {
        "stale"}
    assert all(h.source == "artifact" for h in stale.headline)
    for name, res in files.items():  # the same numbers written by kvstate depth eval --out (with provenance)
        path = tmp_path / "models" / name / "depth_eval.json"
        path.unlink()
        append_run(path, {"model": name, "results": res},
                   Recorder(code=EVAL_CODE, models=[tmp_path / "models" / name]).finish())
    text = card_text(run)
    assert "p = 0.5" in text and "| 0.5 | `0_0_2_2` | 10.200 [10.10, 10.30] |" in text
    section = build(tmp_path, tmp_path / "models")
    status = {h.target: h.status or ("met" if h.met else "missed") for h in section.headline}
    assert status["R-CLA keep 0.5 >= the equal-KV dense baseline on retrieval (paired interval not below 0)"] == "met"
    assert status["R-CLA keep 0.5 perplexity <= the equal-KV dense baseline's (paired)"] == "met"  # 10.2 vs 10.5
    assert status["R-CLA keep 0.5 retrieval >= 0.9 x its keep 1 (paired)"] == "met"  # 0.93 vs 0.855 on the same items
    assert status["R-CLA keep 0.5 perplexity <= 1.03 x its keep 1 (paired)"] == "met"  # +2.0%, no text spread
    assert status["R-CLA keep 1 within the no-routing control's interval (ppl and score)"] == "met"
    control = next(h for h in section.headline if "no-routing" in h.target)
    assert "paired R-CLA − control: ppl -0.1% [-0.1%, -0.1%] over 4 texts (band -1.00%, +1.00%), score -1.0 points " \
        "[-3.0, +0.0] over 100 items (band -5.0, +5.0)" in control.measured  # inside the control's own interval
    assert status["post-hoc sharing of the base model measurably worse at keep <= 0.5"] == "met"
    assert status["R-CLA within 2% ppl of the CLA2 specialist at 0_0_2_2 (paired)"] == "met"  # +1.0%
    assert status["the CLA2 specialist degrades off its pattern (keep 0.25)"] == "met"
    assert all(status[t] == "met" for t in status if t.startswith("KV bytes"))
    paired = [h for h in section.headline if "paired" in h.target and "worst pattern" not in h.target]
    assert len(paired) == 5 and all(h.ci is not None and h.ci[0] <= h.ci[1] for h in paired)
    assert (tmp_path / "depth_quality_vs_kv.png").is_file()
    files["ref-attn-kv1"] = rows([9.0, 30.0, 80.0], [0.99, 0.1, 0.0])  # a baseline better than R-CLA: missed
    path = tmp_path / "models" / "ref-attn-kv1" / "depth_eval.json"
    path.unlink()
    append_run(path, {"model": "ref-attn-kv1", "results": files["ref-attn-kv1"]},
               Recorder(code=EVAL_CODE, models=[tmp_path / "models" / "ref-attn-kv1"]).finish())
    worse = {h.target: h.status for h in build(tmp_path, tmp_path / "models").headline}
    assert worse["R-CLA keep 0.5 perplexity <= the equal-KV dense baseline's (paired)"] == "missed"
    assert worse["R-CLA keep 0.5 >= the equal-KV dense baseline on retrieval (paired interval not below 0)"] == "missed"


def test_cli_depth_train_writes_model_and_card(start, tmp_path):
    from typer.testing import CliRunner

    from kvstate.cli import app

    out = tmp_path / "cli-run"
    r = CliRunner().invoke(app, ["depth", "train", "--model", str(start), "--out", str(out), "--p", "0.5",
                                 "--tokens", "512", "--length", "64", "--set", "log_every=1", "--set", "bf16=false"])
    assert r.exit_code == 0, r.output
    assert load_state(out)["depth"]["p"] == 0.5 and "p = 0.5" in (out / "README.md").read_text()
