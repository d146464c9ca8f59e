"""Training with stochastic KV routing: depth_train on a tiny start model, and 2-process DDP under torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvstate.depth.patterns import PatternError
from kvstate.depth.training import DepthTrainConfig, depth_train
from kvstate.errors import KVStateError
from kvstate.eval.train import TrainConfig, load_state, train

SMALL = {"hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 128, "num_layers": 4,
         "start_length": 64, "max_length": 64, "tokens_per_step": 256, "bf16": False, "threads": 1}
FAST = {"lr": 2e-3, "log_every": 5, "warmup_steps": 2, "threads": 1}


@pytest.fixture(scope="module")
def start(tmp_path_factory):
    out = tmp_path_factory.mktemp("depth") / "start"
    train(TrainConfig(minutes=5, max_steps=2, **SMALL), out, progress=False, log=lambda *_: None)
    return out


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
    import torch, torch.distributed as dist
    import kvstate.depth.training as T

    seen = {}
    factory = T._routing_factory
    def spy(cfg, pattern):  # keep each rank's in-memory model to compare weights across ranks
        f = factory(cfg, pattern)
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
    print("RESULT", json.dumps({"rank": rank, "draws": state["depth"]["parts"][-1]["draw_counts"],
                                "curve": [c["loss"] for c in state["curve"]],
                                "sync": float((gathered[0] - gathered[1]).abs().max())}))
""")


def test_two_process_ddp_loss_falls_and_ranks_stay_in_sync(start, tmp_path):
    """torchrun, gloo, 2 CPU processes: each rank draws its own routes; weights stay identical."""
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src"), "OMP_NUM_THREADS": "1"}
    out = tmp_path / "ddp"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(worker), str(start), str(out), json.dumps(FAST)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(line.split("RESULT ", 1)[1]) for line in proc.stdout.splitlines() if "RESULT " in line]
    assert sorted(r["rank"] for r in results) == [0, 1]
    assert results[0]["draws"] != results[1]["draws"]  # each rank draws its own routes
    curve = next(r["curve"] for r in results if r["rank"] == 0)
    assert curve[-1] < curve[0], curve  # the loss falls
    assert all(r["sync"] == 0.0 for r in results)  # ranks hold identical weights (DDP all-reduced every step)
