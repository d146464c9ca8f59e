"""Quest-like with quantized pages (quest4 / quest2): pages dequantize within the quantizer's bound, the slow tier
holds exactly the codes and value ranges (counted by hand), and the fast tier is Quest-like's."""

import torch

from kvstate.lab.semantic import methods
from kvstate.lab.semantic.methods import Context
from kvstate.lab.semantic.methods.quest_quant import QuantPageStore
from kvstate.models import tiny_model
from kvstate.semantic import SegmentConfig, semantic_attention

T, Q = 150, 5
SEG = SegmentConfig(sinks=2, recent=8)


def _build(name, model, ids, budget=0.6):
    pre = methods.prefill(model, ids)
    return methods.get(name).build(model, None, ids, budget, Context(None, SEG), pre)


def _ids(seed, n):
    return torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_pages_dequantize_within_the_quantizer_bound_and_the_slow_tier_is_the_codes():
    model = tiny_model("qwen3")
    ids = _ids(0, T)
    raw = _build("quest", model, ids)
    errors = {}
    for name, bits in (("quest4", 4), ("quest2", 2)):
        cache = _build(name, model, ids)
        err = 0.0
        for lr, lq in zip(raw.semantic_layers, cache.semantic_layers, strict=True):
            r, s = lr.store, lq.store
            assert isinstance(s, QuantPageStore) and s.bits == bits and s.n_mid == r.slow_k.shape[1] > 0
            h, m, d = r.slow_k.shape
            assert torch.equal(s.anchor_k, r.anchor_k) and torch.equal(s.page_min, r.page_min)
            assert s.fast_nbytes() == r.fast_nbytes() and s.full_nbytes() == r.full_nbytes()
            # by hand: key and value codes (bits per element, packed), each value token's lo / hi in fp32
            row = d * bits // 8
            assert s.slow_nbytes() == h * m * row * 2 + h * m * 2 * 4, (s.slow_nbytes(), h, m, d)
            tok = torch.arange(m)
            k, v = s.read_pages(tok, torch.float32)
            pid = tok // s.page
            step_k = (r.page_max[:, pid] - r.page_min[:, pid]) / (2**bits - 1)  # (H, M, D) per channel, per page
            lo_v, hi_v = r.slow_v.amin(-1, keepdim=True), r.slow_v.amax(-1, keepdim=True)
            step_v = (hi_v - lo_v) / (2**bits - 1)
            assert bool(((k - r.slow_k).abs() <= step_k / 2 + 1e-5).all()), "a key left its quantizer's bound"
            assert bool(((v - r.slow_v).abs() <= step_v / 2 + 1e-5).all()), "a value left its quantizer's bound"
            assert bool((k >= r.page_min[:, pid] - 1e-6).all() and (k <= r.page_max[:, pid] + 1e-6).all())
            err = max(err, float((k - r.slow_k).abs().max()))
        errors[bits] = err
    assert 0 < errors[4] < errors[2], errors


@torch.no_grad()
def test_every_page_read_is_close_to_quest_and_fewer_bits_further():
    model = tiny_model("qwen3")
    ids, q = _ids(0, T), torch.tensor([_ids(1, Q)])
    out = {}
    for name in ("quest", "quest4", "quest2"):
        cache = _build(name, model, ids, budget=1.0)
        for layer in cache.semantic_layers:
            layer.store.top_k = 10**6
        with semantic_attention(model):
            out[name] = model(input_ids=q, position_ids=torch.arange(T, T + Q)[None], cache=cache).logits
        assert cache.expanded_fraction() == 1.0
    d4, d2 = (out["quest4"] - out["quest"]).abs().max(), (out["quest2"] - out["quest"]).abs().max()
    assert 0 < d4 < d2, (float(d4), float(d2))
