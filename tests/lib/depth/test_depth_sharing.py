"""Cross-layer KV sharing and stochastic routing on tiny HF models: cached path == full recompute."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DummyLayer

from kvstate.depth.attention import layer_specs
from kvstate.depth.patterns import PatternError, cla, keep, none, parse_pattern, top_shared
from kvstate.depth.routing import StochasticKVRouting
from kvstate.depth.sharing import apply_sharing, kv_bytes, sharing_cache
from kvstate.errors import UnsupportedModelError
from kvstate.models import cache_nbytes
from kvstate.models.families import text_config
from kvstate.models.state import restore_cache, snapshot_cache
from kvstate.models.tiny import tiny_model

TOL = 1e-4


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def model(request):
    return tiny_model(request.param, seed=1, num_hidden_layers=4)


def presets(config):
    specs = layer_specs(config)
    return [none(specs), cla(specs, 2), cla(specs, 4), top_shared(specs, 1), top_shared(specs, 3), keep(specs, 0.75),
            parse_pattern("0_1_0_1")]


def _ids(t=14, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 120, (1, t), generator=g)


@torch.inference_mode()
def test_prefill_and_decode_through_the_sharing_cache_equal_full_recompute(model):
    ids = _ids()
    base = model(ids).logits
    for pattern in presets(model.config):
        with apply_sharing(model, pattern):
            full = model(ids, use_cache=False).logits  # (1, T, V)
            cache = sharing_cache(model.config, pattern)
            parts = [model(ids[:, :9], cache=cache, use_cache=True).logits]
            for t in range(9, ids.shape[1]):
                parts.append(model(ids[:, t:t + 1], cache=cache, use_cache=True).logits)
        assert torch.allclose(torch.cat(parts, 1), full, atol=TOL), pattern
        if pattern.owners != tuple(range(4)):
            assert (full - base).abs().max() > 1e-2  # sharing changes the model: the test can tell patterns apart
        else:
            assert torch.allclose(full, base, atol=TOL)


@torch.inference_mode()
def test_sharing_cache_bytes_equal_owner_tensors(model):
    ids = _ids(11)
    for pattern in presets(model.config):
        with apply_sharing(model, pattern):
            cache = sharing_cache(model.config, pattern)
            model(ids, cache=cache, use_cache=True)
        owners = [cache.layers[i] for i in pattern.owners]
        assert all(isinstance(cache.layers[i], DummyLayer) for i in range(4) if i not in pattern.owners)
        assert cache_nbytes(cache) == sum(la.keys.nbytes + la.values.nbytes for la in owners)
        assert cache_nbytes(cache) == kv_bytes(pattern, model.config, torch.float32) * ids.shape[1]


@torch.inference_mode()
def test_generate_works_under_every_preset_and_matches_recompute(model):
    ids = _ids(8)
    for pattern in presets(model.config):
        with apply_sharing(model, pattern):
            out = model.generate(ids, max_new_tokens=6, do_sample=False, return_dict_in_generate=True,
                                 output_logits=True, pad_token_id=0)
            full = model(out.sequences[:, :-1], use_cache=False).logits  # (1, T + 5, V)
            assert isinstance(out.cache, DynamicCache) and sum(
                isinstance(la, DummyLayer) for la in out.cache.layers) == 4 - len(pattern.owners)
        gen = torch.stack(out.logits, 1)  # (1, 6, V)
        assert torch.allclose(gen, full[:, ids.shape[1] - 1:], atol=TOL), pattern
    assert getattr(text_config(model.config), "kv_sharing_modes", None) is None  # restored on exit


def test_non_owners_skip_their_kv_projections(model):
    pattern = parse_pattern("0_0_2_0")
    calls = {i: 0 for i in range(4)}
    hooks = [layer.self_attn.k_proj.register_forward_hook(lambda *_a, i=i: calls.__setitem__(i, calls[i] + 1))
             for i, layer in enumerate(model.model.layers)]
    hooks += [layer.self_attn.v_proj.register_forward_hook(lambda *_a, i=i: calls.__setitem__(i, calls[i] + 1))
              for i, layer in enumerate(model.model.layers)]
    try:
        with torch.inference_mode(), apply_sharing(model, pattern):
            model(_ids(6), use_cache=False)
            model(_ids(6), cache=sharing_cache(model.config, pattern), use_cache=True)
    finally:
        for h in hooks:
            h.remove()
    assert calls == {0: 4, 1: 0, 2: 4, 3: 0}


def _deployable(pattern, config):
    try:
        pattern.validate(layer_specs(config))
    except PatternError:
        return False
    return True


@torch.inference_mode()
@pytest.mark.parametrize("rule", ["paper", "owner"])
def test_routing_is_identical_with_and_without_a_cache(model, rule):
    ids = _ids(10, seed=3)
    with StochasticKVRouting(model, 0.5, seed=7, rule=rule) as r1:
        a = [model(ids, use_cache=False).logits for _ in range(12)]
    with StochasticKVRouting(model, 0.5, seed=7, rule=rule) as r2:
        b = [model(ids, cache=DynamicCache(config=model.config), use_cache=True).logits for _ in range(12)]
    assert r1.draws == r2.draws and len({d.sources for d in r1.draws}) > 1
    assert all(torch.allclose(x, y, atol=TOL) for x, y in zip(a, b, strict=True))
    deployable = [(x, d) for x, d in zip(a, r1.draws, strict=True) if _deployable(d, model.config)]
    assert deployable and (rule == "paper" or len(deployable) == 12)  # every owner draw is deployable
    for x, d in deployable:  # a pass whose route is a deployable pattern equals that pattern's sharing
        with apply_sharing(model, d):
            assert torch.allclose(model(ids, use_cache=False).logits, x, atol=TOL)


@pytest.mark.parametrize("rule", ["paper", "owner"])
def test_routing_gradients_flow_and_draws_follow_p(model, rule):
    specs = layer_specs(model.config)
    model.train()
    try:
        with StochasticKVRouting(model, 0.6, seed=0, rule=rule) as routing:
            for _ in range(300):
                routing._draw()  # the same draws a forward pass makes, without the compute
            loss = model(_ids(8), labels=_ids(8)).loss
            loss.backward()
            grads = [layer.self_attn.k_proj.weight.grad for layer in model.model.layers]
    finally:
        model.eval()
        model.zero_grad(set_to_none=True)
    own = [sum(d.is_owner(i) for d in routing.draws[:300]) / 300 for i in range(len(specs))]
    assert own[0] == 1.0 and all(abs(o - 0.6) < 4 * (0.24 / 300) ** 0.5 for o in own[1:]), own
    assert torch.isfinite(loss) and len(routing.draws) == 301  # the forward pass drew its own pattern
    read = set(routing.draws[-1].sources)  # a layer's K/V projections learn iff some layer read its own K/V
    assert all((g is not None and bool(g.abs().sum() > 0)) == (i in read) for i, g in enumerate(grads))


def test_hooks_are_removed_on_exceptions(model):
    ids = _ids(5)
    with torch.inference_mode():
        base = model(ids).logits
        with pytest.raises(RuntimeError, match="boom"), apply_sharing(model, parse_pattern("0_0_0_0")):
            raise RuntimeError("boom")
        with pytest.raises(RuntimeError, match="boom"), StochasticKVRouting(model, 0.0, seed=0):
            raise RuntimeError("boom")
        after = model(ids).logits
    assert torch.equal(base, after)
    assert all("forward" not in layer.self_attn.__dict__ for layer in model.model.layers)
    assert not model.model._forward_pre_hooks and not model.model._forward_hooks
    assert getattr(text_config(model.config), "kv_sharing_modes", None) is None


def test_bad_patterns_and_p(model):
    with pytest.raises(PatternError, match="layer 1 reads layer 2"), apply_sharing(model, parse_pattern("0_2_2_3")):
        pass
    with pytest.raises(PatternError, match="5 layers"), apply_sharing(model, parse_pattern("0_1_2_3_4")):
        pass
    with pytest.raises(PatternError, match="p="):
        StochasticKVRouting(model, 1.2)


def test_unsupported_attention_raises():
    hybrid = tiny_model("qwen3_5", num_hidden_layers=4)
    with pytest.raises(UnsupportedModelError, match=r"not supported by kvstate\.depth"), apply_sharing(
            hybrid, none(layer_specs(hybrid.config))):
        pass


@torch.inference_mode()
def test_shared_cache_snapshots_and_restores_through_kvstate_models(model):
    from kvstate.models.families import layer_kinds

    pattern = cla(layer_specs(model.config), 2)
    ids = _ids(12)
    with apply_sharing(model, pattern):
        full = model(ids, use_cache=False).logits
        cache = sharing_cache(model.config, pattern)
        model(ids[:, :8], cache=cache, use_cache=True)
        snap = snapshot_cache(cache, 8, layer_kinds(model.config))
        assert snap.nbytes == cache_nbytes(cache)
        restored = restore_cache(model.config, snap)
        tail = model(ids[:, 8:], cache=restored, use_cache=True).logits
    assert torch.allclose(tail, full[:, 8:], atol=TOL)
