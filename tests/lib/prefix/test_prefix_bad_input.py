"""The prefix API's bad input: one clear KVStateError naming the argument and the fix, the store untouched."""

from __future__ import annotations

import pytest
import torch

from kvstate.errors import KVStateError
from kvstate.models import segmented_prefill
from kvstate.prefix.engine import SparsePrefixCache
from tests.conftest import get_model, random_ids

MiB = 1 << 20

BAD_IDS = [
    (lambda ids: ids.float(), "dtype torch.float32; token ids must be integers"),
    (lambda ids: ids.float() + 0.5, "dtype torch.float32"),
    (lambda ids: torch.cat([ids[:, :-1], torch.tensor([[128]])], 1), "token id 128, outside this model's vocabulary"),
    (lambda ids: torch.cat([ids[:, :-1], torch.tensor([[-1]])], 1), "token id -1, outside"),
    (lambda ids: torch.cat([ids, ids], 0), r"shape \(2, 12\).*batch of one"),
    (lambda ids: ids.unsqueeze(0), r"shape \(1, 1, 12\)"),
    (lambda ids: ids[:, :0], r"non-empty"),
    (lambda ids: ids.tolist(), "must be a torch.Tensor"),
]


@pytest.mark.parametrize("make, message", BAD_IDS)
@pytest.mark.parametrize("verb", ["lookup", "prefill", "insert"])
def test_bad_ids_raise_one_clear_error_and_leave_the_store_alone(make, message, verb) -> None:  # type: ignore[no-untyped-def]
    model = get_model("qwen3_5")
    cache = SparsePrefixCache(model, 16 * MiB, slots_per_entry=2, align=8)
    ids = random_ids(12, seed=3)
    stored = cache.prefill(ids)
    before = cache.metrics
    bad = make(ids)
    with pytest.raises(KVStateError, match=message) as err:
        if verb == "insert":
            cache.insert(bad, stored.cache)
        else:
            getattr(cache, verb)(bad)
    assert "input_ids" in str(err.value)
    assert cache.metrics == before


def test_insert_refuses_a_cache_another_model_built() -> None:
    ours, theirs = get_model("qwen3_5"), get_model("bamba")
    cache = SparsePrefixCache(ours, 16 * MiB, slots_per_entry=2, align=8)
    ids = random_ids(12, seed=4)
    foreign = SparsePrefixCache(theirs, 16 * MiB, slots_per_entry=2, align=8).prefill(ids).cache
    with pytest.raises(KVStateError, match=r"insert: cache .*this model"):
        cache.insert(ids, foreign)
    assert cache.metrics.requests == 0 and cache.store.nodes() == []
    assert cache.insert(ids, cache.prefill(ids).cache)  # its own is accepted


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3", "mamba2"])
def test_insert_refuses_a_cache_computed_for_other_tokens_and_a_right_insert_hits_exactly(family: str) -> None:
    model = get_model(family)
    cache = SparsePrefixCache(model, 16 * MiB, slots_per_entry=2, align=8)
    x, y = random_ids(20, seed=5), random_ids(20, seed=6)
    of_x = cache.prefill(x).cache  # holds x's first 19 tokens
    before, nodes = cache.metrics, len(cache.store.nodes())
    with pytest.raises(KVStateError, match=r"insert: the cache was computed for other tokens than the first 19"):
        cache.insert(y, of_x)
    assert cache.metrics == before and len(cache.store.nodes()) == nodes
    # nothing of x was filed under y: y's next request is exact
    tail = random_ids(6, seed=7)
    y_next = torch.cat([y, tail], 1)
    res = cache.prefill(y_next)
    assert float((res.logits - segmented_prefill(model, y_next).logits).abs().max()) < 1e-4
    # x's cache under x plus a continuation (what generate appends) is accepted and the next hit is exact
    out = model.generate(x, cache=of_x, attention_mask=torch.ones_like(x), max_new_tokens=4, min_new_tokens=4,
                         do_sample=False, pad_token_id=0)
    assert cache.insert(out, of_x)
    x_next = torch.cat([out, tail], 1)
    hit = cache.prefill(x_next)
    assert hit.reused_tokens == out.shape[1] - 1
    assert float((hit.logits - segmented_prefill(model, x_next).logits).abs().max()) < 1e-4
