"""SparsePrefixCache with tree placement (exact DP over the radix tree) against full recomputation."""

from __future__ import annotations

import pytest
import torch

from kvstate.errors import KVStateError
from kvstate.models import segmented_prefill
from kvstate.prefix import PrefixCacheConfig
from kvstate.prefix.engine import SparsePrefixCache
from tests.conftest import get_model, random_ids


def test_tree_placement_hit_is_exact_vs_recompute():
    model = get_model("qwen3_5")  # hybrid: attention KV and Gated DeltaNet states
    cache = SparsePrefixCache(
        model, PrefixCacheConfig(64 << 20, slots_per_entry=2, align=8, placement="tree")
    )
    doc = random_ids(96, seed=11)
    reused = []
    for i in range(3):
        ids = torch.cat([doc, random_ids(6, seed=20 + i)], 1)
        res = cache.prefill(ids)
        reused.append(res.reused_tokens)
        torch.testing.assert_close(res.logits, segmented_prefill(model, ids).logits, atol=1e-4, rtol=0)
    # the second request captures at the document's end (the true overlap), the third resumes from it
    assert reused[0] == 0 and reused[2] == 96 and cache.metrics.tokens_lost_to_missing_checkpoint <= 96


def test_unknown_placement_is_one_clear_error():
    with pytest.raises(KVStateError, match="placement='forest'"):
        PrefixCacheConfig(1 << 20, placement="forest")
