"""Byte accounting from the config equals the bytes of a real cache; families and loading errors."""

from __future__ import annotations

import json

import pytest
import torch
import transformers as tf

from kvstate.errors import ModelLoadError, UnsupportedModelError
from kvstate.models import (
    LayerKind,
    checkpoint_bytes,
    chunk_size,
    describe,
    kv_bytes_per_token,
    layer_kinds,
    load_config,
    load_model,
    qwen35_08b_config,
    segmented_prefill,
)
from tests.conftest import FAMILIES, get_model, random_ids

EXPECTED_KINDS = {
    "llama": {LayerKind.ATTENTION},
    "qwen3": {LayerKind.ATTENTION},
    "qwen3_5": {LayerKind.ATTENTION, LayerKind.RECURRENT},
    "qwen3_next": {LayerKind.ATTENTION, LayerKind.RECURRENT},
    "mamba2": {LayerKind.RECURRENT},
    "bamba": {LayerKind.ATTENTION, LayerKind.RECURRENT},
    "falcon_h1": {LayerKind.HYBRID},
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", FAMILIES)
def test_config_accounting_equals_measured_cache_bytes(family, dtype):
    model = get_model(family, dtype)
    n = 24
    snap = segmented_prefill(model, random_ids(n, seed=11), cuts=[n]).snapshots[n]
    assert snap.attention_nbytes == n * kv_bytes_per_token(model.config, dtype)
    assert snap.recurrent_nbytes == checkpoint_bytes(model.config, dtype)
    assert set(layer_kinds(model.config)) == EXPECTED_KINDS[family]


def test_chunk_sizes_come_from_the_model():
    assert chunk_size(get_model("qwen3_5").config) == 64
    assert chunk_size(get_model("qwen3_next").config) == 64
    for fam in ("mamba2", "bamba", "falcon_h1"):
        assert chunk_size(get_model(fam).config) == 256
    assert chunk_size(get_model("qwen3").config) is None
    # read from the config, not a table: a changed chunk size is reported
    assert chunk_size(tf.Mamba2Config(chunk_size=128)) == 128


def test_qwen35_08b_shape_matches_the_published_figures():
    info = describe(qwen35_08b_config())
    assert info.kv_bytes_per_token == 12 * 1024  # 6 attention layers × 2 × 2 heads × 256 × bf16
    assert info.checkpoint_bytes == 18 * (16 * 128 * 128 * 4 + 6144 * 4 * 2)
    assert round(info.checkpoint_tokens) == 1608
    assert info.layer_kinds.count("recurrent") == 18
    assert json.loads(json.dumps(info.as_json()))["chunk_size"] == 64


def test_unsupported_family_names_the_supported_ones():
    with pytest.raises(UnsupportedModelError, match="supported families: Llama"):
        layer_kinds(tf.GPT2Config())


def test_load_errors(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_config(tmp_path / "nope")
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        load_config(tmp_path)
    tf.ViTConfig().save_pretrained(tmp_path / "vit")
    with pytest.raises(ModelLoadError, match="not a causal language model"):
        load_config(tmp_path / "vit")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="could not be read"):
        load_config(tmp_path / "bad")


def test_saved_tiny_model_round_trips(tmp_path):
    model = get_model("qwen3_5")
    model.save_pretrained(tmp_path / "m")
    loaded = load_model(tmp_path / "m")
    ids = random_ids(12, seed=3)
    assert torch.equal(segmented_prefill(loaded, ids).logits, segmented_prefill(model, ids).logits)
