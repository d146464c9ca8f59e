"""The lab's one perplexity: scored on top of a cache holding the context == one forward over the whole text."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DynamicCache

from kvstate.errors import KVStateError
from kvstate.lab.perplexity import TextNLL, continuation_nll, pooled_perplexity
from tests.conftest import get_model, random_ids

REL = 1e-4


def one_forward_nll(model, ids: torch.Tensor, start: int) -> float:
    """Brute force: logits of the whole text in one call, NLL of ids[start + 1:]."""
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, start:-1].float()  # (T - 1 - start, V)
    return float(torch.nn.functional.cross_entropy(logits, ids[0, start + 1:], reduction="sum"))


def prefilled(model, ids: torch.Tensor, start: int) -> DynamicCache:
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids[:, :start], position_ids=torch.arange(start)[None], cache=cache, use_cache=True)
    return cache


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5", "bamba"])
@pytest.mark.parametrize("stepwise", [False, True])
def test_cached_context_equals_one_forward(family, stepwise):
    model = get_model(family)
    ids = random_ids(40, seed=7)
    start = 23
    want = one_forward_nll(model, ids, start)
    got = continuation_nll(model, ids, start, prefilled(model, ids, start), stepwise=stepwise)
    assert got.tokens == 40 - start - 1 and got.seconds > 0
    assert abs(got.nll - want) <= REL * abs(want)
    scratch = continuation_nll(model, ids[0].tolist(), start)  # no cache: one forward over the text
    assert scratch.tokens == got.tokens and abs(scratch.nll - want) <= REL * abs(want)


def test_whole_text_from_scratch_and_pooling():
    model = get_model("qwen3")
    texts = [random_ids(20, seed=8), random_ids(31, seed=9)]
    rows = [continuation_nll(model, ids) for ids in texts]
    assert [r.tokens for r in rows] == [19, 30]
    wants = [one_forward_nll(model, ids, 0) for ids in texts]
    assert all(abs(r.nll - w) <= REL * abs(w) for r, w in zip(rows, wants, strict=True))
    ppl = pooled_perplexity(rows)
    assert abs(ppl - math.exp(sum(wants) / 49)) <= REL * ppl
    assert math.isnan(pooled_perplexity([])) and pooled_perplexity([TextNLL(0.0, 3, 0.0)]) == 1.0


def test_bad_arguments_name_the_fix():
    model = get_model("qwen3")
    ids = random_ids(10, seed=10)
    with pytest.raises(KVStateError, match=r"start=9 must be an int in 0\.\.8"):
        continuation_nll(model, ids, 9)
    with pytest.raises(KVStateError, match="stepwise=True needs a cache"):
        continuation_nll(model, ids, 3, stepwise=True)
