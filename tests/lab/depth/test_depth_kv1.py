"""The equal-KV dense baseline's start: KV heads merged by their mean (GQA uptraining), saved for depth train."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvstate.errors import KVStateError, UnsupportedModelError
from kvstate.lab.depth.kv1 import init_kv1, merge_kv_heads
from kvstate.lab.depth.train import DepthTrainConfig, depth_train
from kvstate.lab.harness import load_reference
from kvstate.lab.training.train import load_state
from kvstate.models import cache_nbytes
from kvstate.models.tiny import tiny_model
from tests.lab.depth.conftest import FAST


def _ids(t=12):
    return torch.randint(3, 120, (2, t), generator=torch.Generator().manual_seed(0))


def _kv_bytes_per_token(model, ids):
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(ids, cache=cache, use_cache=True)
    return cache_nbytes(cache) / ids.numel()


def _twin_heads(model):
    """Make each layer's second KV head a copy of its first (k_proj / v_proj rows)."""
    d = model.config.head_dim
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.weight[d:2 * d] = proj.weight[:d]
    return model


def test_merged_model_halves_kv_bytes_and_equals_the_original_with_twin_heads():
    ids = _ids()
    model = _twin_heads(tiny_model("qwen3", seed=2, num_hidden_layers=3))
    merged = merge_kv_heads(model, 1)
    assert merged.config.num_key_value_heads == 1 and model.config.num_key_value_heads == 2
    assert _kv_bytes_per_token(merged, ids) * 2 == _kv_bytes_per_token(model, ids)
    with torch.inference_mode():
        assert torch.allclose(merged(ids).logits, model(ids).logits, atol=1e-5)
    other = tiny_model("qwen3", seed=2, num_hidden_layers=3)  # distinct heads: the mean is another model
    with torch.inference_mode():
        assert not torch.allclose(merge_kv_heads(other, 1)(ids).logits, other(ids).logits, atol=1e-3)
    k = other.model.layers[1].self_attn.k_proj.weight
    d = other.config.head_dim
    assert torch.allclose(merge_kv_heads(other, 1).model.layers[1].self_attn.k_proj.weight, (k[:d] + k[d:]) / 2)


def test_bad_merges_are_refused():
    model = tiny_model("qwen3", seed=2, num_hidden_layers=2)
    for bad in (3, 0, True, 1.0):
        with pytest.raises(KVStateError, match="kv_heads="):
            merge_kv_heads(model, bad)
    with pytest.raises(UnsupportedModelError, match="not supported"):
        merge_kv_heads(tiny_model("qwen3_5", num_hidden_layers=4), 1)


def test_init_kv1_writes_a_model_that_depth_train_continues(start, tmp_path):
    from typer.testing import CliRunner

    from kvstate.cli import app

    kv1 = tmp_path / "kv1"
    result = CliRunner().invoke(app, ["depth", "init-kv1", "--model", str(start), "--out", str(kv1)])
    assert result.exit_code == 0, result.output
    assert "2 -> 1 KV heads" in result.output
    model, _ = load_reference(kv1)
    state = load_state(kv1)
    assert model.config.num_key_value_heads == 1 and state["config"]["num_kv_heads"] == 1
    assert state["kv1"]["kv_heads"] == [2, 1] and state["step"] == load_state(start)["step"]
    ids = _ids(16)
    original, _ = load_reference(start)
    assert _kv_bytes_per_token(model, ids) * 2 == _kv_bytes_per_token(original, ids)
    out = depth_train(kv1, tmp_path / "kv1-trained", DepthTrainConfig(p=1.0, length=64, tokens=2 * 256), overrides=FAST,
                      progress=False, log=lambda *_: None)
    assert out["step"] == state["step"] + 2 and out["depth"]["start"] == str(kv1)
    assert load_reference(tmp_path / "kv1-trained")[0].config.num_key_value_heads == 1
    with pytest.raises(KVStateError, match="already holds output"):
        init_kv1(start, kv1)
