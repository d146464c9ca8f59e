"""Captures only where they pay for their forward call, and ``prefill(..., full_state=True)`` (one call fewer)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstate.models import segmented_prefill
from kvstate.prefix import PrefixCacheConfig
from kvstate.prefix.engine import SparsePrefixCache
from kvstate.prefix.store import paying_captures
from tests.conftest import get_model, random_ids

MiB = 1 << 20


def _savings(w: np.ndarray, keep: list[int], start: int, end: int) -> list[float]:
    """Written out: each kept capture's saving, mass of the depths it serves × tokens over the previous state."""
    anchors = [start, *keep, end]
    return [(p - anchors[i]) * float(w[p : anchors[i + 2]].sum()) for i, p in enumerate(keep)]


def test_a_capture_one_token_past_the_resume_point_is_dropped_and_a_document_end_kept():
    w = np.zeros(301)
    w[121] = 2.0  # this request's own overlap and its declared boundary
    w[200] = 1.0  # one earlier request parted at the end of a document
    assert paying_captures(w, [121, 200], start=120, end=299, min_saving=32) == [200]
    assert paying_captures(w, [121, 200], start=120, end=299, min_saving=0) == [121, 200]
    # alone it serves the overlaps at 121 and 200 (mass 3), one token each
    assert paying_captures(w, [121], start=120, end=299, min_saving=3) == [121]
    assert paying_captures(w, [121], start=120, end=299, min_saving=3.5) == []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=12, max_size=40), st.data())
def test_what_remains_all_pays_off_and_dropping_starts_with_the_worst(mass, data):
    w = np.asarray(mass, dtype=float)
    n = w.size - 1
    start = data.draw(st.integers(0, n - 3))
    cands = sorted(data.draw(st.sets(st.integers(start + 1, n - 2), min_size=1, max_size=6)))
    thr = data.draw(st.floats(0, 40))
    keep = paying_captures(w, cands, start, n - 1, thr)
    assert set(keep) <= set(cands)
    assert all(s >= thr for s in _savings(w, keep, start, n - 1))
    dropped = [p for p in cands if p not in keep]
    if dropped:  # the first drop was the candidate saving least of the full set, and it did not pay
        full = _savings(w, cands, start, n - 1)
        assert min(full) < thr


class _Calls:
    """Counts the model's forward calls."""

    def __init__(self, model):
        self.n = 0
        self.handle = model.register_forward_pre_hook(lambda *a: setattr(self, "n", self.n + 1))


@pytest.mark.parametrize("family", ["qwen3_5", "mamba2", "qwen3"])
def test_full_state_chat_turns_resume_at_the_previous_end_in_one_call_and_decode_exactly(family):
    model = get_model(family)
    cache = SparsePrefixCache(model, PrefixCacheConfig(64 * MiB, 4, align=8))
    calls = _Calls(model)
    convo = random_ids(20, seed=1)
    prev = 0
    for turn in range(4):
        calls.n = 0
        res = cache.prefill(convo, boundaries=[prev] if prev else None, full_state=True)
        n = convo.shape[1]
        assert res.reused_tokens == prev and res.recomputed_tokens == n - prev
        # later turns: no call boundary at n-1, none at the boundary one token past the resume point (the
        # first request, on a store that has seen nothing, spreads its checkpoints evenly)
        assert calls.n == 1 or turn == 0
        torch.testing.assert_close(res.logits, segmented_prefill(model, convo).logits, atol=1e-4, rtol=0)
        tok = res.logits.argmax(-1, keepdim=True)  # (1, 1): decode from the cache after all n tokens
        nxt = model(input_ids=tok, position_ids=torch.tensor([[n]]), cache=res.cache, use_cache=True).logits[:, -1]
        grown = torch.cat([convo, tok], 1)
        torch.testing.assert_close(nxt, segmented_prefill(model, grown).logits, atol=1e-4, rtol=0)
        prev = n
        convo = torch.cat([convo, random_ids(9 + 4 * turn, seed=10 + turn)], 1)
    calls.handle.remove()


def test_full_state_full_hit_computes_nothing_and_returns_the_whole_prompt():
    model = get_model("qwen3_5")
    cache = SparsePrefixCache(model, PrefixCacheConfig(64 * MiB, 4, align=8))
    ids = random_ids(30, seed=3)
    cache.prefill(ids, full_state=True)
    calls = _Calls(model)
    res = cache.prefill(ids, full_state=True)
    assert res.reused_tokens == 30 and res.recomputed_tokens == 0 and calls.n == 0
    tok = res.logits.argmax(-1, keepdim=True)
    nxt = model(input_ids=tok, position_ids=torch.tensor([[30]]), cache=res.cache, use_cache=True).logits[:, -1]
    torch.testing.assert_close(nxt, segmented_prefill(model, torch.cat([ids, tok], 1)).logits, atol=1e-4, rtol=0)
    # generate's contract for the same prompt: no state at n-1 is stored, so it resumes below and recomputes
    res2 = cache.prefill(ids)
    assert 0 < res2.reused_tokens < 29 and res2.reused_tokens + res2.recomputed_tokens == 30
    torch.testing.assert_close(res2.logits, res.logits, atol=1e-4, rtol=0)
    calls.handle.remove()


def test_generate_contract_skips_a_boundary_that_saves_one_token_but_keeps_a_document_end():
    model = get_model("qwen3_5")
    cache = SparsePrefixCache(model, PrefixCacheConfig(64 * MiB, 4, align=8))
    calls = _Calls(model)
    first = random_ids(40, seed=4)
    cache.prefill(first, boundaries=[32])  # a document of 32 tokens, then a question
    assert calls.n == 3  # calls end at the document end and at n-1
    q2 = torch.cat([first[:, :32], random_ids(6, seed=5)], 1)
    assert cache.prefill(q2).reused_tokens == 32
    turn = torch.cat([first, random_ids(12, seed=6)], 1)
    calls.n = 0
    res = cache.prefill(turn, boundaries=[40])  # 40 is one token past the resume point (39)
    assert res.reused_tokens == 39 and calls.n == 2
    calls.handle.remove()
    zero = SparsePrefixCache(model, PrefixCacheConfig(64 * MiB, 4, align=8, capture_min_saving=0))
    zero.prefill(first)
    calls = _Calls(model)
    zero.prefill(turn, boundaries=[40])  # every planned position and boundary captured, as before
    assert calls.n == 3
    calls.handle.remove()
