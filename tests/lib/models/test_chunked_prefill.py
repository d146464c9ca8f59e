"""Chunked prefill: extra call boundaries every ``chunk`` tokens, a hook between calls, the same logits."""

from __future__ import annotations

import itertools
import random

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


def _steps(start: int, total: int, cuts: list[int], chunk: int) -> list[int]:
    """Brute force: the forward calls segmented_prefill makes (every cut, every chunk-th token from start, the end),
    packed greedily into steps of at most ``chunk`` tokens; the positions where a step ends (but the last)."""
    ends = sorted({c for c in cuts if start < c <= total} | {total} | set(range(start + chunk, total, chunk)))
    out, begun, prev = [], start, start
    for end in ends:
        if end - begun > chunk:  # this call does not fit the step: the step ended at the call before
            out.append(prev)
            begun = prev
        prev = end
    return out


def test_the_budgeted_hook_runs_where_greedy_steps_of_chunk_tokens_end() -> None:
    from kvstate.prefix.engine import budgeted

    rng = random.Random(0)
    for _ in range(300):
        total = rng.randrange(2, 60)
        start = rng.randrange(0, total)
        chunk = rng.randrange(1, 20)
        cuts = rng.sample(range(start + 1, total + 1), k=min(total - start, rng.randrange(0, 6)))
        ends = sorted({c for c in cuts} | {total} | set(range(start + chunk, total, chunk)))
        calls: list[int] = []
        hook = budgeted(lambda calls=calls: calls.append(1), start, total, cuts, chunk)
        assert hook is not None
        fired = []
        for end in ends[:-1]:  # segmented_prefill calls the hook after every call but the last
            before = len(calls)
            hook()
            fired += [end] * (len(calls) - before)
        assert fired == _steps(start, total, cuts, chunk)
        steps = [start, *fired, total]
        assert all(0 < b - a <= chunk for a, b in itertools.pairwise(steps))
    assert budgeted(None, 0, 10, [], 4) is None
    assert budgeted(print, 0, 10, [], None) is print


def test_checkpoint_cuts_inside_a_chunk_do_not_add_steps() -> None:
    """A cold prefill with declared boundaries inside its chunks: the hook runs after every chunk of tokens, as
    without the cuts (before, each cut was a step of its own: a decode stall and a later first token)."""
    model = get_model("qwen3_5")
    cache = SparsePrefixCache(model, 1 << 25, slots_per_entry=8, align=1)
    q = random_ids(40, seed=7)
    calls: list[int] = []
    res = cache.prefill(q, boundaries=[7, 13, 21, 30], full_state=True, chunk=10, between=lambda: calls.append(1))
    torch.testing.assert_close(res.logits, segmented_prefill(model, q).logits, atol=1e-4, rtol=0)
    assert len(calls) == 3  # steps of 10 tokens: 0-10, 10-20, 20-30, 30-40
