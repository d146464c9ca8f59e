"""The prefix API's bad input: one clear KVStateError naming the argument and the fix, the store untouched."""

from __future__ import annotations

import pytest
import torch

from kvstate.errors import KVStateError
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
