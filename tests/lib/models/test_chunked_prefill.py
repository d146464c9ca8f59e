"""Chunked prefill: extra call boundaries every ``chunk`` tokens, a hook between calls, the same logits."""

from __future__ import annotations

import pytest
import torch

from kvstate.errors import KVStateError
from kvstate.models import segmented_prefill
from kvstate.prefix.engine import SparsePrefixCache
from tests.conftest import FAMILIES, get_model, random_ids


@pytest.mark.parametrize("family", FAMILIES)
def test_chunks_give_the_one_call_logits_and_call_the_hook_between_calls(family: str) -> None:
    model = get_model(family)
    ids = random_ids(23, seed=3)
    whole = segmented_prefill(model, ids)
    calls: list[int] = []
    out = segmented_prefill(model, ids, cuts=[10], chunk=6, between=lambda: calls.append(1))
    torch.testing.assert_close(out.logits, whole.logits, atol=1e-4, rtol=0)
    assert len(calls) == 4 and set(out.snapshots) == {10}  # calls end at 6, 10, 12, 18, 23: 4 in between


def test_the_prefix_cache_prefills_in_chunks_from_a_hit() -> None:
    model = get_model("qwen3_5")
    cache = SparsePrefixCache(model, 1 << 25, slots_per_entry=2, align=8)
    doc = random_ids(24, seed=4)
    cache.prefill(torch.cat([doc, random_ids(3, seed=5)], 1), boundaries=[24])
    q = torch.cat([doc, random_ids(17, seed=6)], 1)
    calls: list[int] = []
    res = cache.prefill(q, boundaries=[24], full_state=True, chunk=5, between=lambda: calls.append(1))
    torch.testing.assert_close(res.logits, segmented_prefill(model, q).logits, atol=1e-4, rtol=0)
    assert res.reused_tokens == 24 and len(calls) == 3  # 17 new tokens in calls of 5, 5, 5, 2


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_a_bad_chunk_is_one_clear_error(bad) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(KVStateError, match="chunk="):
        segmented_prefill(get_model("llama"), random_ids(5), chunk=bad)
