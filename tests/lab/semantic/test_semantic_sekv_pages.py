"""sekv_pages: every page read is attention over the anchors and the dequantized middle; pages are ranked by
q . mean key; a pass's bf16 reads stay within the budget and bf16.counts reports them; too small a budget reads
no page."""

import torch
from transformers import DynamicCache

from kvstate.lab.semantic import bf16
from kvstate.lab.semantic.methods import sekv_pages as S
from kvstate.lab.semantic.methods.quest import PageStore
from kvstate.models import tiny_model
from kvstate.semantic import SegmentConfig, SemanticConfig, semantic_attention
from kvstate.semantic.quant import _dequantize, unpack

T, Q = 150, 5
SEG = SegmentConfig(sinks=2, recent=8)


def _store(h=1, m=10, page=4, d=8, budget=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    keys, vals = torch.randn(h, m, d, generator=g), torch.randn(h, m, d, generator=g)
    anchor = torch.randn(1, h, 3, d, generator=g)
    pad = -m % page
    pages = torch.cat([keys, keys[:, -1:].expand(-1, pad, -1)], 1).view(h, -(-m // page), page, d)
    return S.code_pages(PageStore(anchor, anchor.clone(), pages.amin(2), pages.amax(2), keys, vals, page, budget), 4), keys


def test_the_mean_key_is_over_each_pages_own_tokens():
    store, keys = _store()
    assert torch.allclose(store.page_mean[0, 0], keys[0, 0:4].mean(0)) and torch.allclose(store.page_mean[0, 2],
                                                                                         keys[0, 8:10].mean(0))


def test_reading_every_page_is_attention_over_anchors_and_the_dequantized_middle():
    store, _ = _store(budget=1.0)
    q = torch.randn(1, 2, 1, 8, generator=torch.Generator().manual_seed(3))  # Hq = 2 over H = 1
    out = store.attend(q, 0.5)
    assert store.expanded == [1.0]
    k = _dequantize(unpack(store.k_codes, 4, 8), store.page_min[:, torch.arange(10) // 4],
                    store.page_max[:, torch.arange(10) // 4], 4)
    v = store.v_quant.reconstruct()
    allk, allv = torch.cat([store.anchor_k[0, 0], k[0]]), torch.cat([store.anchor_v[0, 0], v[0]])
    for head in range(2):
        want = torch.softmax(allk @ q[0, head, 0] * 0.5, 0) @ allv
        assert (out[0, head, 0] - want).abs().max() < 1e-5


def test_pages_are_ranked_by_mean_key_and_reads_stay_within_the_bf16_budget():
    d, page = 4, 2
    keys = torch.zeros(1, 8, d)
    for p in range(4):
        keys[0, 2 * p:2 * p + 2, p] = 1.0
    anchor = torch.zeros(1, 1, 1, d)
    pages = keys.view(1, 4, page, d)
    store = S.code_pages(PageStore(anchor, anchor.clone(), pages.amin(2), pages.amax(2), keys, keys * 10, page, 1.0), 4)
    floats, codes = store._page_cost(0)
    one = floats * S.FLOAT_BYTES + codes
    full = 9 * 2 * d * S.FLOAT_BYTES
    store.budget = (store._fixed_elements() * S.FLOAT_BYTES + one) / full  # room for exactly one page
    q = torch.zeros(1, 1, 1, d)
    q[0, 0, 0, 2] = 3.0
    out = store.attend(q, 1.0)
    assert store.expanded == [0.25] and out[0, 0, 0].argmax() == 2  # page 2's values, read alone
    (f, c), = store.parts
    assert f * S.FLOAT_BYTES + c <= store.budget * full + 1e-9 and store.pass_reads(2) == [f * 2 + c]
    store.budget = store._fixed_elements() * S.FLOAT_BYTES / full  # anchors and mean keys only
    store.attend(q, 1.0)
    assert store.expanded[-1] == 0.0 and store.parts[-1][1] == 0


@torch.no_grad()
def test_the_method_in_a_model_counts_bf16_reads_within_its_budget_and_differs_from_full():
    model = tiny_model("qwen3")
    ids, q = torch.randint(3, 128, (1, T)), torch.randint(3, 128, (1, Q))
    pre = DynamicCache(config=model.config)
    model(input_ids=ids, position_ids=torch.arange(T)[None], cache=pre)
    import copy
    ref = model(input_ids=q, position_ids=torch.arange(T, T + Q)[None], cache=copy.deepcopy(pre)).logits
    cache = S.CodePage16Cache(model, config=SemanticConfig(budget=0.3, segment=SEG, zoom="none", slow_tier=False))
    cache.adopt(pre)
    cache.compress()
    with semantic_attention(model):
        out = model(input_ids=q, position_ids=torch.arange(T, T + Q)[None], cache=cache).logits
    b = bf16.counts(cache)
    assert 0 < b.attended_bytes_peak <= 0.3 * b.full_bytes
    assert b.total_bytes < 0.5 * b.full_bytes and (out - ref).abs().max() > 1e-4
    stores = [layer.store for layer in cache.semantic_layers]
    assert b.attended_bytes_peak == sum(s.pass_reads(2)[-1] for s in stores)
    assert all(0 < s.expanded[-1] < 1 for s in stores)


def test_two_bit_values_hold_fewer_bytes_than_four_bit():
    s4, _ = _store(m=64, page=4, d=8)
    from kvstate.lab.semantic.methods.quest import PageStore as P
    raw = P(s4.anchor_k, s4.anchor_v, s4.page_min, s4.page_max, torch.randn(1, 64, 8), torch.randn(1, 64, 8), 4, 1.0)
    a, b = S.code_pages(raw, 4), S.code_pages(raw, 4, 2)
    assert b.v_bits == 2 and b.slow_nbytes() < a.slow_nbytes() and b.k_codes.shape == a.k_codes.shape
