"""SEKV cache against oracles: full attention, a dense summary layout, measured tensor bytes."""

import itertools

import numpy as np
import pytest
import torch
from transformers import DynamicCache

from kvstate.errors import BudgetError, IntegrityError, KVStateError, OutputError, UnsupportedModelError
from kvstate.models import model_fingerprint, tiny_model
from kvstate.semantic import (
    RouterConfig,
    RouterMismatchError,
    SegmentConfig,
    SemanticCache,
    SemanticRouter,
    prefill_and_compress,
    semantic_attention,
)
from kvstate.semantic.lowrank import RankGate, encode
from kvstate.semantic.segment import fast_bytes
from tests.semantic_util import lowrank_config

T, Q = 160, 6
SEG = SegmentConfig(sinks=2, recent=8, min_span=2, max_span=12)


def _ids(seed, n, vocab=128):
    return torch.randint(3, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _full_logits(model, ids, q):
    cache = DynamicCache(config=model.config)
    model(input_ids=ids, cache=cache, position_ids=torch.arange(ids.shape[1])[None])
    return model(input_ids=q, cache=cache, position_ids=torch.arange(T, T + q.shape[1])[None]).logits, cache


@torch.no_grad()
def _semantic_logits(model, cache, ids, q):
    prefill_and_compress(model, cache, ids)
    with semantic_attention(model):
        return model(input_ids=q, cache=cache, position_ids=torch.arange(T, T + q.shape[1])[None]).logits


def test_reconstruction_error_falls_with_rank_and_is_exact_at_full_rank():
    x = torch.randn(2, 24, 16, generator=torch.Generator().manual_seed(0))
    x = x + 3 * torch.randn(2, 24, 1) @ torch.randn(2, 1, 16)  # a dominant direction, as keys have
    errs = [float((encode(x, r, None, False).reconstruct() - x).norm() / x.norm()) for r in range(1, 17)]
    assert all(a > b for a, b in itertools.pairwise(errs))
    assert errs[-1] < 1e-6 and errs[0] > 0.05
    gated = encode(x, None, RankGate(), False)  # untrained gates keep the first ~93% of the energy
    assert 1 <= gated.rank < 16


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen3_5"])
def test_every_span_expanded_at_full_rank_equals_full_attention(family):
    model = tiny_model(family)
    ids, q = _ids(1, T), _ids(2, Q)
    ref, _ = _full_logits(model, ids, q)
    cache = SemanticCache(model, config=lowrank_config(budget=0.3, zoom="all", rank=64, segment=SEG))
    out = _semantic_logits(model, cache, ids, q)
    assert len(cache.segmentation.spans) >= 5
    assert (out - ref).abs().max() < 1e-5
    lossy = SemanticCache(model, config=lowrank_config(budget=0.3, zoom="none", segment=SEG))
    assert (_semantic_logits(model, lossy, ids, q) - ref).abs().max() > 1e-3  # the oracle can fail


def test_unexpanded_spans_equal_dense_summary_layout():
    """Summary + log|S| equals attention over a cache where every span token holds the span's mean."""
    model = tiny_model("qwen3")
    ids, q = _ids(3, T), _ids(4, Q)
    cache = SemanticCache(model, config=lowrank_config(budget=0.3, zoom="none", segment=SEG))
    out = _semantic_logits(model, cache, ids, q)
    full = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, cache=full, position_ids=torch.arange(T)[None])
    dense = DynamicCache(config=model.config)
    for i, layer in enumerate(full.layers):
        k, v = layer.keys.clone(), layer.values.clone()
        for a, b in cache.segmentation.spans:
            k[:, :, a:b] = k[:, :, a:b].mean(2, keepdim=True)
            v[:, :, a:b] = v[:, :, a:b].mean(2, keepdim=True)
        dense.update(k, v, i)
    with torch.no_grad():
        ref = model(input_ids=q, cache=dense, position_ids=torch.arange(T, T + Q)[None]).logits
    assert (out - ref).abs().max() < 1e-5


def test_decode_rolls_tokens_into_spans_and_stays_exact():
    model = tiny_model("qwen3")
    ids = _ids(5, T)
    seg = SegmentConfig(sinks=2, recent=4, min_span=2, max_span=4)
    cache = SemanticCache(model, config=lowrank_config(budget=0.7, zoom="all", rank=64, segment=seg))
    full = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, cache=full, position_ids=torch.arange(T)[None])
    prefill_and_compress(model, cache, ids)
    spans0 = cache.semantic_layers[0].store.n_spans
    with semantic_attention(model), torch.no_grad():
        for t, tok in enumerate(_ids(6, 12)[0]):
            pos = torch.tensor([[T + t]])
            a = model(input_ids=tok.view(1, 1), cache=full, position_ids=pos).logits
            b = model(input_ids=tok.view(1, 1), cache=cache, position_ids=pos).logits
            assert (a - b).abs().max() < 1e-5
    assert cache.semantic_layers[0].store.n_spans > spans0
    assert cache.get_seq_length() == T + 12


@torch.no_grad()
def _decode_logits(model, cache, steps=20):
    with semantic_attention(model):
        return torch.cat([model(input_ids=tok.view(1, 1), cache=cache, position_ids=torch.tensor([[T + t]])).logits
                          for t, tok in enumerate(_ids(6, steps)[0])])


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_adopt_equals_prefill_and_a_fork_decodes_as_a_deep_copy(family):
    import copy

    model = tiny_model(family)
    ids = _ids(5, T)
    seg = SegmentConfig(sinks=2, recent=4, min_span=2, max_span=12)
    config = lowrank_config(budget=0.5, segment=seg)  # learned zoom, low rank, sticky: every record in use
    direct = SemanticCache(model, config=config)
    prefill_and_compress(model, direct, ids)
    pre = DynamicCache(config=model.config)
    with torch.no_grad():
        logits = model(input_ids=ids, cache=pre, position_ids=torch.arange(T)[None]).logits
    kept = [(layer.keys.clone(), layer.values.clone()) for layer in pre.layers if hasattr(layer, "keys")]
    adopted = SemanticCache(model, config=config)
    adopted.adopt(pre)
    from kvstate.semantic import surprisal

    adopted.compress(surprisal(logits, ids))
    assert all(torch.equal(k, layer.keys) and torch.equal(v, layer.values)
               for (k, v), layer in zip(kept, [x for x in pre.layers if hasattr(x, "keys")], strict=True))
    for a, b in zip(direct.semantic_layers, adopted.semantic_layers, strict=True):
        assert torch.equal(a.store.anchor_k, b.store.anchor_k) and torch.equal(a.store.sum_v, b.store.sum_v)
        assert [f.rank for pair in a.store.slow for f in pair] == [f.rank for pair in b.store.slow for f in pair]
    ref = copy.deepcopy(direct, memo={id(direct.router): direct.router, id(model.config): model.config})
    fork = direct.fork()
    before = direct.byte_counts()
    got = _decode_logits(model, fork)
    assert direct.byte_counts() == before and direct.get_seq_length() == T  # the original is untouched
    assert torch.equal(got, _decode_logits(model, ref)) and fork.byte_counts() == ref.byte_counts()
    assert fork.semantic_layers[0].store.n_spans > direct.semantic_layers[0].store.n_spans  # tokens were folded
    assert torch.equal(_decode_logits(model, direct.fork()), got)  # and the original still decodes the same
    fresh = direct.fork(lowrank_config(budget=0.5, segment=seg, sticky=False))
    assert fresh.config.sticky is False and direct.config.sticky is True
    with pytest.raises(KVStateError, match="more than sticky"):
        direct.fork(lowrank_config(budget=0.4, segment=seg))
    with pytest.raises(KVStateError, match="already holds tokens"):
        direct.adopt(pre)


def test_budget_accounting_equals_tensor_bytes():
    model = tiny_model("qwen3")
    ids = _ids(7, T)
    cache = SemanticCache(model, config=lowrank_config(budget=0.5, segment=SEG))
    prefill_and_compress(model, cache, ids)
    layers = cache.semantic_layers
    k0 = layers[0].store.anchor_k
    h, d, e = k0.shape[1], k0.shape[3], k0.element_size()
    # bounds routing: mean key / value and min / max key per span and head, no routing summary
    token_bytes, span_bytes = 2 * h * d * e, h * 4 * d * e + e
    predicted = len(layers) * fast_bytes(cache.segmentation, token_bytes, span_bytes)
    measured_fast = sum(t.nbytes for layer in layers for t in (layer.store.anchor_k, layer.store.anchor_v,
                        layer.store.sum_k, layer.store.sum_v, layer.store.route, layer.store.log_n,
                        layer.store.k_lo, layer.store.k_hi))
    measured_slow = sum(x.nbytes for layer in layers for pair in layer.store.slow for lr in pair for x in (lr.a, lr.b))
    got = cache.nbytes()
    assert got["fast"] == predicted == measured_fast
    assert got["slow"] == measured_slow > 0
    assert got["fast"] <= (1 - cache.config.expand_share) * 0.5 * got["full"]  # the rest is for expansions
    assert got["full"] == len(layers) * T * token_bytes


def test_generate_runs_with_semantic_cache():
    model = tiny_model("qwen3")
    ids, q = _ids(8, T), _ids(9, Q)
    full_ids = torch.cat([ids, q], 1)
    ref = model.generate(full_ids, max_new_tokens=5, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, cache=DynamicCache(config=model.config))
    cache = SemanticCache(model, config=lowrank_config(budget=0.3, zoom="all", rank=64, segment=SEG))
    prefill_and_compress(model, cache, ids)
    with semantic_attention(model):
        out = model.generate(full_ids, max_new_tokens=5, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, cache=cache)
    assert out.sequences.shape == (1, T + Q + 5)
    assert max(float((a - b).abs().max()) for a, b in zip(ref.logits, out.logits, strict=True)) < 1e-4
    assert model.config._attn_implementation != "sekv"  # the context manager switched back


def test_router_save_load_round_trip_and_fingerprint(tmp_path):
    model = tiny_model("qwen3")
    router = SemanticRouter(RouterConfig.from_model_config(model.config), seed=3)
    with torch.no_grad():
        router.theta.add_(0.7)
    router.save(tmp_path / "r", model_fingerprint(model))
    back = SemanticRouter.load(tmp_path / "r", model)
    for (n1, p1), (n2, p2) in zip(router.state_dict().items(), back.state_dict().items(), strict=True):
        assert n1 == n2 and torch.equal(p1, p2)
    other = tiny_model("qwen3", seed=1)
    with pytest.raises(RouterMismatchError, match="fingerprint"):
        SemanticRouter.load(tmp_path / "r", other)
    assert not list((tmp_path / "r").glob(".*"))  # no temp files left


def test_router_save_keeps_results_beside_it_and_refuses_another_kind_of_directory(tmp_path):
    model = tiny_model("qwen3")
    router = SemanticRouter(RouterConfig.from_model_config(model.config))
    router.save(tmp_path / "r", model_fingerprint(model))
    (tmp_path / "r" / "eval.json").write_text("{}")
    router.save(tmp_path / "r", model_fingerprint(model), {"steps": 2})
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["eval.json", "manifest.json", "router.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r"]  # no staging sibling left
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "thesis.txt").write_text("keep me")
    with pytest.raises(OutputError, match="is not a SEKV router directory"):
        router.save(notes, model_fingerprint(model))
    assert [p.name for p in notes.iterdir()] == ["thesis.txt"]


@pytest.mark.parametrize("damage", ["truncate", "flip", "manifest"])
def test_a_damaged_router_file_is_one_integrity_error_naming_it(tmp_path, damage):
    model = tiny_model("qwen3")
    SemanticRouter(RouterConfig.from_model_config(model.config)).save(tmp_path / "r", model_fingerprint(model))
    name = "manifest.json" if damage == "manifest" else "router.safetensors"
    path = tmp_path / "r" / name
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2] if damage != "flip" else raw[:-1] + bytes([raw[-1] ^ 0xFF]))
    with pytest.raises(IntegrityError, match=rf"{name}.*kvstate semantic train") as err:
        SemanticRouter.load(tmp_path / "r", model)
    assert str(path) in str(err.value)


def test_bad_inputs():
    model = tiny_model("qwen3")
    ids = _ids(10, T)
    cache = SemanticCache(model, config=lowrank_config(budget=0.02, segment=SEG))
    with pytest.raises(BudgetError, match=r"minimum is \d+ bytes"):
        prefill_and_compress(model, cache, ids)
    with pytest.raises(UnsupportedModelError, match="no standard attention"):
        SemanticCache(tiny_model("mamba2"))
    with pytest.raises(KVStateError, match="budget"):
        lowrank_config(budget=1.5)
    cache = SemanticCache(model, config=lowrank_config(budget=0.6, segment=SEG))
    with pytest.raises(KVStateError, match="surprisal values"):
        cache.compress(np.zeros(5))
    prefill_and_compress(model, cache, ids)
    with pytest.raises(KVStateError, match="semantic_attention"), torch.no_grad():
        model(input_ids=_ids(11, 1), cache=cache, position_ids=torch.tensor([[T]]))


def test_without_summaries_every_span_expanded_equals_full_attention_and_holds_more_anchors(monkeypatch):
    from kvstate.semantic.store import SpanStore

    # an unlimited allowance, so routing expands every span (at budget 1.0 the bounds alone leave too little room)
    monkeypatch.setattr(SpanStore, "allowance", lambda self, budget: 1 << 40)
    model = tiny_model("qwen3")
    ids = torch.randint(3, 128, (1, 96), generator=torch.Generator().manual_seed(11))
    q = torch.randint(3, 128, (1, 4), generator=torch.Generator().manual_seed(12))
    full = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, cache=full)
        ref = model(input_ids=q, cache=full).logits
    seg = SegmentConfig(sinks=2, recent=8, min_span=2, max_span=8)
    fast, errs = {}, {}
    for summaries in (True, False):
        cfg = lowrank_config(budget=1.0, segment=seg, slow="raw", summaries=summaries, sticky=False)
        cache = SemanticCache(model, config=cfg)
        prefill_and_compress(model, cache, ids)
        store = cache.semantic_layers[0].store
        fast[summaries] = store.anchor_k.shape[2]  # exact tokens the same fast-tier share holds
        assert (store.sum_k.shape[2] == store.n_spans > 0) == summaries
        with semantic_attention(model), torch.no_grad():
            out = model(input_ids=q, cache=cache).logits
        errs[summaries] = float((out - ref).abs().max())
    assert errs[False] < 1e-4 and errs[True] < 1e-4
    assert fast[False] > fast[True]  # without summary entries the fast tier has room for more anchors
    with pytest.raises(KVStateError, match="summaries=False"):
        lowrank_config(summaries=False, zoom="similarity")
    with pytest.raises(KVStateError, match="summaries=False"):
        lowrank_config(summaries=False, routing="learned")
