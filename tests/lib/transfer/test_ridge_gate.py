"""Ridge maps across models (closed form against a brute-force solve; identity on one model; better than raw on a
perturbed consumer; per-head maps stay within their head; the file and its refusals), the receiving-side gate
(its NLL against a full forward, a faithful cache accepted and a corrupted one refused, the cache left unchanged,
bad input) and the shared producer prefill of item-major benches."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstate.models.tiny import tiny_model
from kvstate.transfer import methods as registry
from kvstate.transfer.gate import GateConfig, GateError, read_gate
from kvstate.transfer.methods import MethodContext, MethodError, producer_states, shared_prefill
from kvstate.transfer.nonlinear import MapError
from kvstate.transfer.ridge import RidgeConfig, RidgeMaps, _Stats, fit_ridge_maps, solve
from kvstate.transfer.states import build_cache, prefill_states
from tests.lib.transfer.conftest import prompts as _prompts


@pytest.fixture(scope="module")
def models() -> tuple[torch.nn.Module, torch.nn.Module]:
    p, c = tiny_model("llama", seed=0), tiny_model("llama", seed=0)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # a 'fine-tuned' consumer: the producer's weights plus relative noise
        for w in c.parameters():
            w.add_(0.2 * w.std() * torch.randn(w.shape, generator=g))
    return p, c


def test_the_closed_form_from_statistics_equals_a_brute_force_ridge_solve() -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(300, 6)) * np.array([1, 2, 3, 0.5, 1, 4]) + 3.0
    y = x @ rng.normal(size=(6, 4)) + rng.normal(size=(300, 4)) + 1.5
    st = _Stats(6, 4)
    for part in np.array_split(np.arange(300), 3):  # streamed in three parts
        st.add(torch.tensor(x[part]), torch.tensor(y[part]))
    for alpha in (1e-4, 0.5):
        w = solve(st.xx, st.xy, alpha).numpy()
        xc, yc = x - x.mean(0), y - y.mean(0)
        lam = alpha * np.var(x, 0).mean()
        a = np.linalg.solve(xc.T @ xc / 300 + lam * np.eye(6), xc.T @ yc / 300)  # brute force: centred normal equations
        b = y.mean(0) - x.mean(0) @ a
        assert np.allclose(w[:-1], a, atol=1e-8) and np.allclose(w[-1], b, atol=1e-8)
    exact = x @ np.diag([1.0, -2, 0.5, 1, 1, 3])[:, :4] + 7.0  # an exact affine relation is recovered
    st2 = _Stats(6, 4)
    st2.add(torch.tensor(x), torch.tensor(exact))
    assert np.allclose(solve(st2.xx, st2.xy, 1e-10).numpy()[:-1], np.diag([1.0, -2, 0.5, 1, 1, 3])[:, :4], atol=1e-5)


@pytest.mark.parametrize("scope", ["head", "layer"])
def test_maps_of_one_model_are_the_identity_and_beat_raw_on_a_perturbed_consumer(models: tuple, scope: str) -> None:
    p, c = models
    held = _prompts(1, 64, seed=9)[0]
    same = fit_ridge_maps(p, p, _prompts(4, 64, seed=1), RidgeConfig(scope=scope))
    ps = prefill_states(p, held)
    for i in range(2):
        k, v = same.apply(i, ps.k[i], ps.v[i])
        assert float((k - ps.k[i]).norm() / ps.k[i].norm()) < 0.05 and float((v - ps.v[i]).norm() / ps.v[i].norm()) < 0.05
    maps = fit_ridge_maps(p, c, _prompts(6, 64, seed=1), RidgeConfig(scope=scope))
    cs = prefill_states(c, held)
    for i in range(2):
        k, v = maps.apply(i, ps.k[i], ps.v[i])
        raw_err = float((ps.k[i] - cs.k[i]).norm() + (ps.v[i] - cs.v[i]).norm())
        assert float((k - cs.k[i]).norm() + (v - cs.v[i]).norm()) < 0.95 * raw_err
    assert len(maps.alphas) == 2 and all(a in (1e-4, 1e-3, 1e-2, 1e-1) for a in maps.alphas)


def test_a_per_head_map_reads_only_its_own_head(models: tuple) -> None:
    p, c = models
    maps = fit_ridge_maps(p, c, _prompts(3, 48, seed=2), RidgeConfig(scope="head"))
    ps = prefill_states(p, _prompts(1, 16, seed=3)[0])
    k, v = ps.k[1].clone(), ps.v[1].clone()
    k2 = k.clone()
    k2[:, 0] += 5.0  # change head 0's keys only
    a, b = maps.apply(1, k, v), maps.apply(1, k2, v)
    assert not torch.allclose(a[0][:, 0], b[0][:, 0]) and torch.equal(a[0][:, 1], b[0][:, 1]) and torch.equal(a[1], b[1])


def test_the_maps_file_round_trips_and_refuses_another_pair_scope_or_a_broken_file(models: tuple, tmp_path) -> None:
    from kvstate.models.fingerprint import model_fingerprint
    from kvstate.transfer.calibrate import CalibrationConfig, calibrate_on

    p, c = models
    maps = fit_ridge_maps(p, c, _prompts(3, 48, seed=4), RidgeConfig(scope="head"))
    path = maps.save(tmp_path / "r.safetensors")
    back = RidgeMaps.load(path)
    assert back.alphas == maps.alphas and all(torch.equal(back.tensors[k], maps.tensors[k]) for k in maps.tensors)
    back.check(model_fingerprint(p), model_fingerprint(c))
    with pytest.raises(MapError, match="another producer"):
        back.check(model_fingerprint(c), model_fingerprint(c))
    codec = calibrate_on(p, c, _prompts(4, 48, seed=0), CalibrationConfig(rank_k=8, rank_v=8, rank_h=16, bits=8,
                                                                         prefixes=4, length=48, suffix=8,
                                                                         aligner_steps=0))
    with pytest.raises(MethodError, match="scope 'head'"):
        registry.get("ridge_layer").check(MethodContext(codec=codec, options={"artifact": str(path)}))
    with pytest.raises(MethodError, match="needs its fitted maps"):
        registry.get("ridge_head").maps(MethodContext(codec=codec))
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(path.read_bytes()[:100])
    with pytest.raises(MethodError, match="ridge-map file"):
        registry.get("ridge_head").check(MethodContext(codec=codec, options={"artifact": str(bad)}))
    with pytest.raises(MapError, match="scope"):
        RidgeConfig(scope="model")
    with pytest.raises(MapError, match="at least 2"):
        fit_ridge_maps(p, c, _prompts(1, 48, seed=4), RidgeConfig())


def test_the_gate_accepts_the_consumers_own_cache_and_refuses_a_corrupted_one(models: tuple) -> None:
    _, c = models
    ids = _prompts(1, 48, seed=6)[0]
    st = prefill_states(c, ids)
    own = build_cache(c, st.k, st.v)
    r = read_gate(c, own, ids, GateConfig(tokens=8))
    assert r.error < 1e-4 and r.accept and len(r.layer_errors) == 2
    lp = torch.log_softmax(st.logits[40:47].double(), -1)  # the oracle: the same tokens' NLL from a full forward
    assert abs(r.nll - float(-lp.gather(1, ids[0, 41:, None]).mean())) < 1e-4
    noisy = [k + 0.5 * k.std() * torch.randn(k.shape, generator=torch.Generator().manual_seed(0)) for k in st.k]
    bad = build_cache(c, noisy, st.v)
    before = [x.clone() for layer in bad.layers for x in (layer.keys, layer.values)]
    r2 = read_gate(c, bad, ids, GateConfig(tokens=8))
    assert r2.error > 0.1 and not r2.accept
    assert all(torch.equal(x, y) for x, y in zip(before, [x for la in bad.layers for x in (la.keys, la.values)],
                                                   strict=True))  # the transferred cache is left as it was
    with pytest.raises(GateError, match="holds 48 tokens"):
        read_gate(c, own, ids[:, :40])
    for kw in ({"tokens": 1}, {"max_error": -1.0}):
        with pytest.raises(GateError):
            GateConfig(**kw)


def test_a_shared_prefill_runs_the_producer_once_per_prompt_and_returns_the_same_states(models: tuple) -> None:
    p, _ = models
    ids = _prompts(1, 24, seed=7)[0]
    calls = []
    h = p.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        plain = producer_states(p, ids, skip=[1])
        with shared_prefill():
            a = producer_states(p, ids)
            b = producer_states(p, ids, skip=[1])
            producer_states(p, _prompts(1, 24, seed=8)[0])
        after = producer_states(p, ids)
    finally:
        h.remove()
    assert len(calls) == 4  # plain, the shared one for ids, the other prompt, after the with
    assert set(b[0]) == {0} == set(plain[0]) and set(a[0]) == {0, 1}
    assert torch.equal(b[0][0], plain[0][0]) and torch.equal(a[1][1], after[1][1])
