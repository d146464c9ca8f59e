"""The one model fingerprint: what the router and the codec record for a model is the same value."""

from __future__ import annotations

import json

import torch

from kvstate.models import model_fingerprint, tiny_model
from kvstate.semantic import RouterConfig, SemanticRouter
from kvstate.transfer import codec as codec_mod
from kvstate.transfer.calibrate import CalibrationConfig, calibrate_on


def test_router_and_codec_record_the_same_fingerprint_for_one_model(tmp_path):
    model = tiny_model("qwen3", seed=0)
    router = SemanticRouter(RouterConfig.from_model_config(model.config))
    router.save(tmp_path / "r", model_fingerprint(model))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 128, (1, 32), generator=g) for _ in range(4)]
    cfg = CalibrationConfig(rank_k=4, rank_v=4, rank_h=8, bits=8, prefixes=4, length=32, suffix=8, aligner_steps=0,
                            patch=0)
    codec = calibrate_on(model, model, prompts, cfg)
    recorded = json.loads((tmp_path / "r" / "manifest.json").read_text())["fingerprint"]
    assert recorded == codec.producer_fp == codec.consumer_fp == model_fingerprint(model)
    assert len(recorded) == 64 and int(recorded, 16) >= 0
    assert codec_mod.model_fingerprint is model_fingerprint  # the codec checks models with the same function


def test_fingerprint_changes_with_weights_dtype_and_architecture():
    model = tiny_model("qwen3", seed=0)
    fp = model_fingerprint(model)
    assert model_fingerprint(tiny_model("qwen3", seed=0)) == fp  # deterministic
    assert model_fingerprint(tiny_model("qwen3", seed=1)) != fp  # other weights
    with torch.no_grad():
        next(model.parameters()).view(-1)[0] += 1e-6
    assert model_fingerprint(model) != fp  # one weight changed by one step
    assert model_fingerprint(tiny_model("qwen3", seed=0).to(torch.bfloat16)) != fp  # same weights, another dtype
    other = tiny_model("qwen3", seed=0)
    other.config.rms_norm_eps = other.config.rms_norm_eps * 10  # same weights, another forward pass
    assert model_fingerprint(other) != fp
