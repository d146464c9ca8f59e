"""Quest-like page selection: every page selected equals full attention; a small budget selects few."""

import pytest
import torch
from transformers import DynamicCache

from kvstate.errors import BudgetError
from kvstate.lab.semantic.methods.quest import QuestCache
from kvstate.models import tiny_model
from kvstate.semantic import SegmentConfig, SemanticConfig, semantic_attention

T, Q = 150, 5
SEG = SegmentConfig(sinks=2, recent=8)


def _ids(seed, n):
    return torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _run(model, cache, ids, q, top_k=None):
    model(input_ids=ids, position_ids=torch.arange(T)[None], cache=cache)
    if isinstance(cache, QuestCache):
        cache.compress()
        for layer in cache.semantic_layers:
            layer.store.top_k = top_k if top_k is not None else layer.store.top_k
        with semantic_attention(model):
            return model(input_ids=q, position_ids=torch.arange(T, T + Q)[None], cache=cache).logits
    return model(input_ids=q, position_ids=torch.arange(T, T + Q)[None], cache=cache).logits


def test_all_pages_selected_equals_full_attention_and_small_budget_differs():
    model = tiny_model("qwen3")
    ids, q = _ids(0, T), _ids(1, Q)
    ref = _run(model, DynamicCache(config=model.config), ids, q)
    wide = QuestCache(model, config=SemanticConfig(budget=1.0, segment=SEG, zoom="none", slow_tier=False))
    assert (_run(model, wide, ids, q, top_k=10**6) - ref).abs().max() < 1e-5
    assert wide.expanded_fraction() == 1.0
    narrow = QuestCache(model, config=SemanticConfig(budget=0.3, segment=SEG, zoom="none", slow_tier=False))
    out = _run(model, narrow, ids, q)
    nb = narrow.nbytes()
    assert nb["fast"] <= 0.3 * T * 2 * 2 * 16 * 4 * 2 + Q * 2 * 2 * 16 * 4 * 2
    assert 0 < narrow.expanded_fraction() < 1 and (out - ref).abs().max() > 1e-4


def test_budget_too_small_names_minimum():
    model = tiny_model("qwen3")
    cache = QuestCache(model, config=SemanticConfig(budget=0.01, segment=SEG, zoom="none", slow_tier=False))
    with pytest.raises(BudgetError, match=r"minimum is \d+ bytes"):
        _run(model, cache, _ids(0, T), _ids(1, Q))


def test_pages_are_ranked_by_the_last_fed_token_by_default_or_by_every_token():
    from kvstate.lab.semantic.methods.quest import PageStore

    d, page = 4, 2
    keys = torch.zeros(1, 8, d)  # (H=1, M=8, D): page p's keys point along axis p (4 pages)
    for p in range(4):
        keys[0, 2 * p:2 * p + 2, p] = 1.0
    values = keys * 100.0  # page p's values live on axis p only: the output says which page was read
    anchor = torch.zeros(1, 1, 1, d)

    def read_page(**kw):
        store = PageStore(anchor, anchor.clone(), keys.view(1, 4, page, d).amin(2), keys.view(1, 4, page, d).amax(2),
                          keys, values, page, budget=1.0, top_k=1, **kw)
        q = torch.zeros(1, 1, 2, d)  # (B, Hq=1, Tq=2, D): an early token points hard at page 0, the last at page 2
        q[0, 0, 0, 0], q[0, 0, 1, 2] = 5.0, 1.0
        out = store.attend(q, 1.0)
        used = out.abs().flatten(0, -2).sum(0)  # per value axis
        assert int((used > 0).sum()) == 1
        return int(used.argmax())

    assert read_page() == 2 and read_page(route_query="last") == 2  # the last token's page (the default)
    assert read_page(route_query="all") == 0  # the max over every fed token: the early token's page
