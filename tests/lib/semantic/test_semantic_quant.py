"""The quantized slow tier and the memory budget: codes round-trip within half a step, bytes per tier are the
tensors held, the unquantized oracle equals full attention, outlier spans stay exact, the memory cap holds
(16:1 at 4K tokens included), and bad input is refused naming the minimum."""

import re

import pytest
import torch
from transformers import DynamicCache

from kvstate.errors import BudgetError, KVStateError
from kvstate.models import tiny_model
from kvstate.semantic import (
    SegmentConfig,
    SemanticCache,
    prefill_and_compress,
    semantic_attention,
)
from kvstate.semantic.lowrank import Raw
from kvstate.semantic.quant import (
    QuantKeys,
    QuantValues,
    outlier_spans,
    pack,
    quantize_keys,
    quantize_values,
    unpack,
)
from tests.semantic_util import lowrank_config

T = 160
SEG = SegmentConfig(sinks=2, recent=8, min_span=2, max_span=12)


def _ids(seed, n, vocab=128):
    return torch.randint(3, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("d", [16, 13])
def test_codes_round_trip_within_half_a_step(bits, d):
    g = torch.Generator().manual_seed(bits + d)
    x = 5 * torch.randn(2, 9, d, generator=g) + torch.randn(2, 1, d, generator=g)  # (H, n, D)
    codes = torch.randint(0, 1 << bits, (2, 9, d), generator=g, dtype=torch.uint8)
    assert torch.equal(unpack(pack(codes, bits), bits, d), codes)
    lo, hi = x.amin(1), x.amax(1)  # (H, D)
    k = quantize_keys(x, lo, hi, bits).dequantize(lo, hi, torch.float32)
    step_k = (hi - lo)[:, None] / ((1 << bits) - 1)  # per channel
    assert ((k - x).abs() <= step_k / 2 + 1e-5).all()
    assert ((k >= lo[:, None]) & (k <= hi[:, None])).all()  # within the bounds routing uses
    qv = quantize_values(x, bits)
    step_v = (x.amax(-1, keepdim=True) - x.amin(-1, keepdim=True)) / ((1 << bits) - 1)  # per token
    assert ((qv.reconstruct() - x).abs() <= step_v / 2 + 1e-5).all()
    assert qv.codes.shape[-1] == -(-d * bits // 8)  # packed: bits per element, not a byte


@pytest.mark.parametrize("sticky", [True, False])
def test_bytes_per_tier_equal_the_tensors_held(sticky):
    model = tiny_model("qwen3")
    cfg = lowrank_config(budget=0.5, memory=0.8, segment=SEG, slow="quant", bits=2, outliers=0.1, sticky=sticky)
    cache = SemanticCache(model, config=cfg)
    prefill_and_compress(model, cache, _ids(1, T))
    with semantic_attention(model), torch.no_grad():
        for t, tok in enumerate(_ids(2, 6)[0]):
            model(input_ids=tok.view(1, 1), cache=cache, position_ids=torch.tensor([[T + t]]))
    stores = [layer.store for layer in cache.semantic_layers]
    fast = sum(x.nbytes for s in stores for x in (s.anchor_k, s.anchor_v, s.sum_k, s.sum_v, s.route, s.log_n,
                                                  s.k_lo, s.k_hi))
    slow = 0
    kinds = set()
    for s in stores:
        for fk, fv in s.slow:
            kinds.add((type(fk).__name__, type(fv).__name__))
            if isinstance(fk, QuantKeys):  # codes only: the key range is the span's bounds, in the fast tier
                assert isinstance(fv, QuantValues)
                slow += fk.codes.nbytes + fv.codes.nbytes + fv.lo.nbytes + fv.hi.nbytes
            else:
                assert isinstance(fk, Raw) and isinstance(fv, Raw)
                slow += fk.x.nbytes + fv.x.nbytes
    assert kinds == {("QuantKeys", "QuantValues"), ("Raw", "Raw")}  # outliers kept exact, the rest quantized
    working = sum(x.nbytes for s in stores for pair in s._working.values() for x in pair)
    assert (working > 0) == sticky  # a sticky working set is held; otherwise expansions are dropped
    b = cache.byte_counts()
    assert b.resident_bytes == fast + working
    assert b.total_bytes == fast + working + slow
    assert cache.nbytes()["slow"] == slow
    assert b.total_bytes <= 0.8 * b.full_bytes


def test_outlier_spans_are_the_least_alike():
    assert outlier_spans([0.9, 0.2, 0.5, 0.2, 0.95], 0.4) == {1, 3}
    assert outlier_spans([0.9, 0.2], 0.0) == set()


def test_unquantized_oracle_equals_full_attention_and_quantized_does_not():
    model = tiny_model("qwen3")
    ids, q = _ids(3, T), _ids(4, 6)
    full = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, cache=full, position_ids=torch.arange(T)[None])
        ref = model(input_ids=q, cache=full, position_ids=torch.arange(T, T + 6)[None]).logits
    errs = {}
    for bits in (16, 8, 2):
        cache = SemanticCache(model, config=lowrank_config(budget=0.5, segment=SEG, zoom="all", slow="quant",
                                                           bits=bits))
        prefill_and_compress(model, cache, ids)
        with semantic_attention(model), torch.no_grad():
            out = model(input_ids=q, cache=cache, position_ids=torch.arange(T, T + 6)[None]).logits
        errs[bits] = float((out - ref).abs().max())
    assert errs[16] < 1e-5
    assert errs[2] > errs[8] > 1e-5  # fewer bits, larger error: the oracle can fail


def test_memory_caps_every_tier_and_the_low_rank_tier_fills_it():
    model = tiny_model("qwen3")
    ids = _ids(5, T)
    totals = []
    for memory in (0.7, 0.9):
        cache = SemanticCache(model, config=lowrank_config(budget=0.5, memory=memory, segment=SEG, max_rank=64))
        prefill_and_compress(model, cache, ids)
        b = cache.byte_counts()
        # the working set is empty before the first pass; its share of the cap is the rest of the read budget
        room = sum(layer.store.allowance(0.5) for layer in cache.semantic_layers)
        assert b.total_bytes + room <= memory * b.full_bytes
        totals.append(b.total_bytes)
    assert totals[1] > totals[0]  # more memory buys rank


def test_sixteen_to_one_memory_fits_at_4k_tokens():
    model = tiny_model("qwen3", head_dim=64, max_position_embeddings=8192)
    t = 4096
    cfg = lowrank_config(budget=0.0625, memory=0.0625, sticky=False, segment=SegmentConfig(max_span=128))
    cache = SemanticCache(model, config=cfg)
    prefill_and_compress(model, cache, _ids(6, t))
    b = cache.byte_counts()
    assert b.total_bytes <= 0.0625 * b.full_bytes


def test_a_memory_that_cannot_hold_the_exact_parts_names_the_minimum_that_fits():
    model = tiny_model("qwen3")
    ids = _ids(7, T)
    for slow in ("quant", "lowrank"):
        cfg = lowrank_config(budget=0.5, memory=0.5, segment=SEG, slow=slow, bits=4)
        with pytest.raises(BudgetError, match=r"memory >= 0\.\d{4}") as err:
            prefill_and_compress(model, SemanticCache(model, config=cfg), ids)
        need = float(re.search(r"memory >= (0\.\d{4})", str(err.value)).group(1)) + 1e-4
        ok = SemanticCache(model, config=lowrank_config(budget=0.5, memory=need, segment=SEG, slow=slow, bits=4))
        prefill_and_compress(model, ok, ids)  # the named minimum fits
    with pytest.raises(BudgetError, match=r"slow tier at its least \(\d+: 4-bit codes"):
        prefill_and_compress(model, SemanticCache(model, config=lowrank_config(
            budget=0.5, memory=0.52, segment=SEG, slow="quant", bits=4)), ids)


@pytest.mark.parametrize("kw,msg", [({"budget": 0.3, "memory": 0.2}, r"memory=0\.2 is below budget=0\.3"),
                                    ({"bits": 3}, r"bits=3 must be one of 2, 4, 8, 16"),
                                    ({"bits": 32}, r"bits=32 must be one of 2, 4, 8, 16")])
def test_bad_settings_are_refused_with_one_clear_error(kw, msg):
    with pytest.raises(KVStateError, match=msg):
        lowrank_config(**kw)


def test_outlier_spans_stay_exact_only_while_the_memory_cap_holds_them():
    model = tiny_model("qwen3")
    ids = _ids(8, T)
    # the floor of 4-bit codes with no outlier kept exact: the refusal names it
    with pytest.raises(BudgetError, match=r"memory >= (0\.\d{4})") as err:
        prefill_and_compress(model, SemanticCache(model, config=lowrank_config(
            budget=0.5, memory=0.5, segment=SEG, slow="quant", bits=4, outliers=0.0)), ids)
    floor = float(re.search(r"memory >= (0\.\d{4})", str(err.value)).group(1)) + 1e-4
    exact = {}
    for name, memory in (("uncapped", None), ("floor", floor)):
        cfg = lowrank_config(budget=0.5, memory=memory, segment=SEG, slow="quant", bits=4, outliers=0.3)
        cache = SemanticCache(model, config=cfg)
        prefill_and_compress(model, cache, ids)  # at the floor the run goes ahead rather than refusing
        b = cache.byte_counts()
        if memory is not None:
            room = sum(layer.store.allowance(0.5) for layer in cache.semantic_layers)
            assert b.total_bytes + room <= memory * b.full_bytes
        store = cache.semantic_layers[0].store
        exact[name] = sum(isinstance(k, Raw) for k, _ in store.slow)
    assert exact["uncapped"] == int(0.3 * store.n_spans) > 0  # no cap: the configured share of spans
    assert exact["floor"] == 0  # no room left for an exact span
