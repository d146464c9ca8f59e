"""The lab's one greedy decode loop: cached decoding == full recompute (tokens and per-step logits)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvstate.depth.attention import layer_specs
from kvstate.depth.patterns import cla
from kvstate.depth.sharing import apply_sharing, sharing_cache
from kvstate.errors import KVStateError
from kvstate.lab.decode import greedy_decode
from kvstate.models.tiny import tiny_model
from tests.conftest import get_model, random_ids

TOL = 1e-5
NEW = 6


@torch.no_grad()
def recompute(model, prompt: torch.Tensor, n: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy decoding the slow way: ``model(ids so far)`` each step, no cache."""
    ids, tokens, logits = prompt, [], []
    for _ in range(n):
        last = model(input_ids=ids, use_cache=False).logits[0, -1].float()  # (V,)
        logits.append(last)
        tokens.append(int(last.argmax()))
        ids = torch.cat([ids, torch.tensor([[tokens[-1]]])], 1)
    return tokens, logits


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5", "bamba"])
def test_cached_decode_equals_full_recompute(family):
    model = get_model(family)
    prompt = random_ids(11, seed=3)
    want_tokens, want_logits = recompute(model, prompt, NEW)
    got = greedy_decode(model, DynamicCache(config=model.config), 0, NEW, None, input_ids=prompt, keep_logits=True)
    assert got.tokens == want_tokens
    assert len(got.logits) == NEW and all(torch.allclose(a, b, atol=TOL, rtol=0)
                                          for a, b in zip(got.logits, want_logits, strict=True))
    assert got.steps == NEW - 1 and len(got.step_ms) == NEW - 1 and all(ms > 0 for ms in got.step_ms)
    assert got.first_ms > 0 and not got.stopped_at_eos


@pytest.mark.parametrize("family", ["qwen3", "bamba"])
def test_decode_after_a_cached_prefix_and_from_given_logits(family):
    model = get_model(family)
    prompt = random_ids(13, seed=4)
    want_tokens, want_logits = recompute(model, prompt, NEW)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=prompt[:, :8], position_ids=torch.arange(8)[None], cache=cache, use_cache=True)
    question = greedy_decode(model, cache, 8, NEW, None, input_ids=prompt[0, 8:].tolist(), keep_logits=True)
    assert question.tokens == want_tokens
    assert all(torch.allclose(a, b, atol=TOL, rtol=0) for a, b in zip(question.logits, want_logits, strict=True))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        first = model(input_ids=prompt, position_ids=torch.arange(13)[None], cache=cache, use_cache=True).logits[0, -1]
    given = greedy_decode(model, cache, 13, NEW, None, logits=first)
    assert given.tokens == want_tokens and given.first_ms == 0.0


def test_decode_through_a_sharing_cache_equals_recompute_under_the_pattern():
    model = tiny_model("qwen3", seed=1, num_hidden_layers=4)
    pattern = cla(layer_specs(model.config), 2)
    prompt = random_ids(9, seed=5)
    with apply_sharing(model, pattern):
        want_tokens, want_logits = recompute(model, prompt, NEW)
        got = greedy_decode(model, sharing_cache(model.config, pattern), 0, NEW, None, input_ids=prompt,
                            keep_logits=True)
    assert got.tokens == want_tokens
    assert all(torch.allclose(a, b, atol=TOL, rtol=0) for a, b in zip(got.logits, want_logits, strict=True))


def test_stops_before_eos_and_at_the_budget():
    model = get_model("qwen3")
    prompt = random_ids(7, seed=6)
    want, _ = recompute(model, prompt, 4)
    eos = want[2]
    got = greedy_decode(model, DynamicCache(config=model.config), 0, 10, eos, input_ids=prompt)
    stop = want.index(eos)
    assert got.tokens == want[:stop] and got.stopped_at_eos and got.steps == stop
    one = greedy_decode(model, DynamicCache(config=model.config), 0, 1, None, input_ids=prompt)
    assert one.tokens == want[:1] and one.steps == 0 and one.decode_s == 0.0 and not one.stopped_at_eos


def test_bad_arguments_name_the_fix():
    model = get_model("qwen3")
    cache = DynamicCache(config=model.config)
    with pytest.raises(KVStateError, match="exactly one of input_ids"):
        greedy_decode(model, cache, 0, 4, None)
    with pytest.raises(KVStateError, match="exactly one of input_ids"):
        greedy_decode(model, cache, 0, 4, None, input_ids=[1, 2], logits=torch.zeros(8))
    with pytest.raises(KVStateError, match="max_new_tokens=0"):
        greedy_decode(model, cache, 0, 0, None, input_ids=[1, 2])
    with pytest.raises(KVStateError, match="input_ids is empty"):
        greedy_decode(model, cache, 0, 2, None, input_ids=[])
