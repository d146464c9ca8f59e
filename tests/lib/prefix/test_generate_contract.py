"""Contract: the cache the prefix cache hands back continues exactly under ``model.generate``.

For every supported family and for a miss, a partial hit and a full hit, the *scores* of greedy
generation from ``SparsePrefixCache.prefill(ids).cache`` equal generation from scratch (fp32, ≤ 1e-4),
on inputs whose argmax is not tied (checked), with no token equal to the pad id.
"""

from __future__ import annotations

import pytest
import torch

from kvstate.errors import KVStateError
from kvstate.models import ResumableCache, restore_cache, segmented_prefill
from kvstate.prefix.engine import SparsePrefixCache
from tests.conftest import FAMILIES, get_model

MiB = 1 << 20
PAD = 0
STEPS = 4


def _ids(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 128, (1, n), generator=g)  # never the pad id


_SCRATCH: dict[tuple[int, tuple[int, ...]], tuple[torch.Tensor, torch.Tensor]] = {}


def _scratch(model, ids):
    key = (id(model), tuple(ids[0].tolist()))
    if key not in _SCRATCH:
        _SCRATCH[key] = _generate(model, ids)
    return _SCRATCH[key]


def _generate(model, ids, cache=None):
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        cache=cache,
        max_new_tokens=STEPS,
        min_new_tokens=STEPS,
        do_sample=False,
        pad_token_id=PAD,
        output_scores=True,
        return_dict_in_generate=True,
    )
    return out.sequences, torch.stack(out.scores, 1)  # (1, STEPS, V); -inf where min_new_tokens bans EOS


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    finite = torch.isfinite(b)
    if a.shape != b.shape or not torch.equal(torch.isfinite(a), finite):
        return float("inf")
    return float((a[finite] - b[finite]).abs().max())


def _serve(model, scenario: str):
    cache = SparsePrefixCache(model, budget_bytes=64 * MiB, slots_per_entry=4, align=8)
    doc = _ids(96, seed=12)  # seed chosen so no step has a top-2 gap under 1e-3 on any family
    if scenario == "miss":
        ids = doc
    elif scenario == "partial":
        cache.prefill(torch.cat([doc, _ids(8, seed=12)], 1))
        ids = torch.cat([doc[:, :77], _ids(9, seed=112)], 1)
    else:
        cache.prefill(doc)
        ids = doc
    res = cache.prefill(ids, attention_mask=torch.ones_like(ids))
    return ids, res


@pytest.mark.parametrize("scenario", ["miss", "partial", "full"])
@pytest.mark.parametrize("family", FAMILIES)
def test_generate_from_prefix_cache_scores_equal_scratch(family, scenario):
    model = get_model(family)
    ids, res = _serve(model, scenario)
    n = ids.shape[1]
    if scenario == "miss":
        assert res.reused_tokens == 0 and res.recomputed_tokens == n
    elif scenario == "partial":
        assert 0 < res.reused_tokens < n and res.recomputed_tokens > 0
    else:
        assert res.reused_tokens == n and res.recomputed_tokens == 0
    assert isinstance(res.cache, ResumableCache) and res.cache.get_seq_length() == n - 1
    seq_ref, scores_ref = _scratch(model, ids)
    top2 = scores_ref.topk(
        2, dim=-1
    ).values  # EOS is -inf in every step (min_new_tokens), never in the top 2  # (1, STEPS, 2)
    assert float((top2[..., 0] - top2[..., 1]).min()) > 1e-3  # the argmax is not tied: a real comparison
    seq, scores = _generate(model, ids, cache=res.cache)
    assert _max_diff(scores, scores_ref) <= 1e-4
    assert torch.equal(seq, seq_ref)


def test_pure_recurrent_cache_refuses_a_second_generate_after_advancing():
    model = get_model("mamba2")
    ids = _ids(40, seed=3)
    seg = segmented_prefill(model, ids, cuts=[39])
    cache = restore_cache(model.config, seg.snapshots[39])
    assert cache.get_seq_length() == 39 and not all(cache.is_linear)
    _generate(
        model, ids, cache=cache
    )  # advances the recurrent state by the last prompt token and the decode steps
    with pytest.raises(KVStateError, match="advanced past the state"):
        cache.get_seq_length()


def test_empty_resumable_cache_generates_like_no_cache():
    model = get_model("mamba2")
    ids = _ids(1, seed=4)
    seq_ref, scores_ref = _generate(model, ids)
    seq, scores = _generate(model, ids, cache=ResumableCache(model.config))
    assert torch.equal(seq, seq_ref) and _max_diff(scores, scores_ref) <= 1e-4


@pytest.mark.parametrize("mask", [torch.tensor([[0, 1, 1, 1]]), torch.ones(1, 3, dtype=torch.long)])
def test_prefill_refuses_a_mask_with_zeros_or_the_wrong_shape(mask):
    model = get_model("qwen3_5")
    cache = SparsePrefixCache(model, budget_bytes=64 * MiB, align=8)
    with pytest.raises(KVStateError, match="attention_mask must be all ones"):
        cache.prefill(_ids(4, seed=5), attention_mask=mask)
    assert cache.store.used_bytes == 0 and not cache.store.nodes()
