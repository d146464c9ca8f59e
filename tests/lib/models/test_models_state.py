"""Oracle tests of the model-state layer: cached / restored paths against recomputation."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvstate.errors import KVStateError
from kvstate.models import (
    chunk_size,
    layer_kinds,
    restore_cache,
    segmented_prefill,
    snapshot_cache,
    tiny_model,
)
from tests.conftest import FAMILIES, RECURRENT_FAMILIES, get_model, random_ids


def _cut_and_total(model) -> tuple[int, int]:
    """A chunk-aligned cut (64 GDN / 256 Mamba2 family; 64 attention-only) and a length past it."""
    c = chunk_size(model.config) or 64
    return c, c + 40


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", FAMILIES)
def test_restore_then_recompute_is_bit_identical_to_segmented(family, dtype):
    model = get_model(family, dtype)
    cut, total = _cut_and_total(model)
    ids = random_ids(total, seed=1)
    ref = segmented_prefill(model, ids, cuts=[cut], all_logits=True)
    resumed_cache = restore_cache(model.config, ref.snapshots[cut])
    resumed = segmented_prefill(model, ids, cache=resumed_cache, start=cut, capture=None, all_logits=True)
    assert torch.equal(resumed.logits, ref.logits[:, cut:])


@pytest.mark.parametrize("family", FAMILIES)
def test_resume_matches_one_shot_prefill_fp32(family):
    model = get_model(family, torch.float32)
    cut, total = _cut_and_total(model)
    ids = random_ids(total, seed=2)
    one_shot = segmented_prefill(model, ids, all_logits=True)
    seg = segmented_prefill(model, ids, cuts=[cut - 17, cut])  # a non-aligned cut too
    resumed = segmented_prefill(model, ids, cache=restore_cache(model.config, seg.snapshots[cut - 17]), start=cut - 17)
    torch.testing.assert_close(resumed.logits, one_shot.logits[:, -1], atol=1e-4, rtol=0)
    torch.testing.assert_close(seg.logits, one_shot.logits[:, -1], atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", RECURRENT_FAMILIES)
def test_resume_bit_identical_to_one_shot_bf16_at_chunk_aligned_cut(family):
    # eager attention: with SDPA, Bamba's one-shot and split calls differ by one bf16 ulp (2e-3) because
    # the SDPA kernel depends on the query length; the recurrent kernels themselves are exact here.
    model = tiny_model(family, seed=0, dtype=torch.bfloat16)
    model.set_attn_implementation("eager")
    cut, total = _cut_and_total(model)
    ids = random_ids(total, seed=3)
    one_shot = segmented_prefill(model, ids, all_logits=True)
    seg = segmented_prefill(model, ids, cuts=[cut])
    resumed = segmented_prefill(model, ids, cache=restore_cache(model.config, seg.snapshots[cut]), start=cut, all_logits=True)
    assert torch.equal(resumed.logits, one_shot.logits[:, cut:])


@pytest.mark.parametrize("family", FAMILIES)
def test_snapshot_is_unaffected_by_later_forwards(family):
    model = get_model(family)
    ids = random_ids(48, seed=4)
    out = segmented_prefill(model, ids, cuts=[16, 32])
    snap = out.snapshots[16]
    before = [
        (
            None if layer.attention is None else layer.attention.keys.clone(),
            None if layer.recurrent is None else layer.recurrent.recurrent.clone(),
        )
        for layer in snap.layers
    ]
    # keep decoding into the live cache and into a cache restored from the snapshot
    restored = restore_cache(model.config, snap)
    segmented_prefill(model, ids, cache=restored, start=16)
    segmented_prefill(model, torch.cat([ids, ids[:, :8]], 1), cache=out.cache, start=48)
    for layer, (k, r) in zip(snap.layers, before, strict=True):
        if k is not None:
            assert torch.equal(layer.attention.keys, k)
        if r is not None:
            assert torch.equal(layer.recurrent.recurrent, r)


@pytest.mark.parametrize("family", RECURRENT_FAMILIES)
def test_restoring_a_zeroed_recurrent_state_changes_the_logits(family):
    model = get_model(family)
    ids = random_ids(40, seed=5)
    out = segmented_prefill(model, ids, cuts=[24])
    snap = out.snapshots[24]
    for layer in snap.layers:
        if layer.recurrent is not None:
            layer.recurrent.recurrent.zero_()
            layer.recurrent.conv.zero_()
    resumed = segmented_prefill(model, ids, cache=restore_cache(model.config, snap), start=24, all_logits=True)
    full = segmented_prefill(model, ids, all_logits=True)
    # well above the 1e-4 tolerance the resume tests accept
    assert (resumed.logits - full.logits[:, 24:]).abs().max() > 1e-3


@pytest.mark.parametrize("family", ["qwen3", "bamba"])
def test_zeroed_attention_kv_changes_the_logits(family):
    model = get_model(family)
    ids = random_ids(40, seed=6)
    out = segmented_prefill(model, ids, cuts=[24])
    for layer in out.snapshots[24].layers:
        if layer.attention is not None:
            layer.attention.values.zero_()
    resumed = segmented_prefill(model, ids, cache=restore_cache(model.config, out.snapshots[24]), start=24)
    assert not torch.allclose(resumed.logits, out.logits, atol=1e-3)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generate_from_restored_cache_equals_from_scratch(family):
    model = get_model(family)
    ids = random_ids(30, seed=7)
    scratch = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    seg = segmented_prefill(model, ids, cuts=[20])
    # the cache holds 20 tokens; generate feeds the rest, then decodes
    cache = restore_cache(model.config, seg.snapshots[20])
    resumed = model.generate(ids, cache=cache, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(resumed, scratch)


@pytest.mark.parametrize("family", ["qwen3_5", "bamba", "falcon_h1"])
def test_dense_kv_sliced_plus_sparse_checkpoint_resumes_exactly(family):
    """Seed 000's hybrid layout: KV of the whole prefix, recurrent state of a shallower checkpoint."""
    model = get_model(family)
    ids = random_ids(64, seed=8)
    full = segmented_prefill(model, ids, cuts=[24, 64], capture="full")
    checkpoint = segmented_prefill(model, ids[:, :40], cuts=[24], capture="recurrent").snapshots[24]
    assert checkpoint.attention_nbytes == 0 and checkpoint.recurrent_nbytes > 0
    cache = restore_cache(model.config, full.snapshots[64], length=24, recurrent=checkpoint)
    resumed = segmented_prefill(model, ids, cache=cache, start=24, all_logits=True)
    ref = segmented_prefill(model, ids, cuts=[24], all_logits=True)
    assert torch.equal(resumed.logits, ref.logits[:, 24:])


def test_restore_refuses_a_recurrent_state_at_the_wrong_position():
    model = get_model("qwen3_5")
    ids = random_ids(48, seed=9)
    out = segmented_prefill(model, ids, cuts=[16, 48])
    with pytest.raises(KVStateError, match="no recurrent state at position 16"):
        restore_cache(model.config, out.snapshots[48], length=16)
    with pytest.raises(KVStateError, match=r"outside 1\.\.48"):
        restore_cache(model.config, out.snapshots[48], length=60)


def test_snapshot_checks_length_and_layers():
    model = get_model("qwen3")
    cache = DynamicCache(config=model.config)
    with pytest.raises(KVStateError, match="holds no attention KV"):
        snapshot_cache(cache, 0, layer_kinds(model.config))
    segmented_prefill(model, random_ids(10), cache=cache)
    with pytest.raises(KVStateError, match="holds 10 tokens"):
        snapshot_cache(cache, 12, layer_kinds(model.config))


def test_segmented_prefill_rejects_bad_cuts():
    model = get_model("qwen3")
    with pytest.raises(KVStateError, match="outside"):
        segmented_prefill(model, random_ids(10), cuts=[0, 5])
    with pytest.raises(KVStateError, match="needs a cache"):
        segmented_prefill(model, random_ids(10), start=3)
