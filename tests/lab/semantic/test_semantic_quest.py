"""Quest-like page selection: every page selected equals full attention; a small budget selects few."""

import pytest
import torch
from transformers import DynamicCache

from kvstate.errors import BudgetError
from kvstate.lab.semantic.quest import QuestCache
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
