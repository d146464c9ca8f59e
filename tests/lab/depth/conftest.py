"""A tiny trained start model (a kvstate train output) shared by the depth lab tests."""

from __future__ import annotations

import pytest

from kvstate.lab.training.train import TrainConfig, train

SMALL = {"hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 128, "num_layers": 4,
         "start_length": 64, "max_length": 64, "tokens_per_step": 256, "bf16": False, "threads": 1}
FAST = {"lr": 2e-3, "log_every": 5, "warmup_steps": 2, "threads": 1}


@pytest.fixture(scope="package")
def start(tmp_path_factory):
    out = tmp_path_factory.mktemp("depth") / "start"
    train(TrainConfig(minutes=5, max_steps=2, **SMALL), out, progress=False, log=lambda *_: None)
    return out
