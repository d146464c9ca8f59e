"""Learned nonlinear maps: on a pair whose true relation is a known nonlinear function the map fits where
the best linear map cannot; maps trained for another pair or codec are refused; the file round-trips."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from kvstate.models.tiny import tiny_model
from kvstate.transfer.calibrate import CalibrationConfig, calibrate_on
from kvstate.transfer.codec import Codec
from kvstate.transfer.nonlinear import (
    KVMaps,
    MapConfig,
    MapError,
    apply_map,
    decode_reuse,
    fit_map,
    kl_div,
    kl_tune,
    kl_tune_kv_maps,
    suffix_logits,
    train_kv_maps,
)
from kvstate.transfer.payload import PayloadError
from kvstate.transfer.states import prefill_states
from tests.lib.transfer.conftest import prompts as _prompts


def _relation(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """y = B tanh(2 A x) + x0 * x1: smooth, strongly nonlinear, known exactly."""
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(6, 16, generator=torch.Generator().manual_seed(1)), torch.randn(16, 4, generator=torch.Generator().manual_seed(2))
    x = torch.randn(n, 6, generator=g)
    y = torch.tanh(2 * x @ a / 6 ** 0.5) @ b + (x[:, :1] * x[:, 1:2])
    return x, y


def _rel_err(pred: torch.Tensor, y: torch.Tensor) -> float:
    return float((pred - y).norm() / (y - y.mean(0)).norm())


def test_map_fits_a_known_nonlinear_relation_where_the_linear_map_cannot() -> None:
    x, y = _relation(4000, seed=0)
    xt, yt = _relation(1000, seed=1)  # held out
    linear = fit_map(x, y, MapConfig(steps=0, hidden=64))
    mlp = fit_map(x, y, MapConfig(steps=1500, hidden=64, lr=3e-3, seed=0))
    e_lin, e_mlp = _rel_err(apply_map(linear, xt), yt), _rel_err(apply_map(mlp, xt), yt)
    assert e_lin > 0.3, e_lin  # the relation is far from linear: the best linear map misses much of it
    assert e_mlp < 0.35 * e_lin, (e_mlp, e_lin)


def test_linear_part_is_the_least_squares_map() -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(500, 5, generator=g)
    w = torch.randn(5, 3, generator=g)
    y = x @ w + 0.7
    t = fit_map(x, y, MapConfig(steps=0, ridge=0.0))
    assert torch.allclose(apply_map(t, x), y, atol=1e-4)
    with pytest.raises(MapError, match="same N"):
        fit_map(x, y[:10], MapConfig())
    with pytest.raises(MapError, match=r"MapConfig\.hidden"):
        MapConfig(hidden=0)


def test_kl_tune_lowers_the_loss_it_is_given() -> None:
    ref = torch.randn(8, 11, generator=torch.Generator().manual_seed(4))
    logits = torch.zeros(8, 11)
    losses = kl_tune([logits], lambda _s: kl_div(ref, logits), steps=50, lr=0.1)
    assert losses[-1] < 0.2 * losses[0] and not logits.requires_grad


@pytest.fixture(scope="module")
def trio() -> tuple:
    p = tiny_model("qwen3", seed=0)
    c = tiny_model("qwen3", seed=0)
    with torch.no_grad():
        for q in c.parameters():
            q.add_(0.3 * q.std() * torch.randn(q.shape, generator=torch.Generator().manual_seed(7)))
    cfg = CalibrationConfig(rank_k=8, rank_v=8, rank_h=8, bits=8, prefixes=8, length=48, suffix=8, aligner_steps=0)
    codec = calibrate_on(p, c, _prompts(), cfg)
    maps = train_kv_maps(p, c, codec, _prompts(), [0, 1], MapConfig(steps=100, hidden=32))
    return p, c, codec, maps


def test_maps_decode_a_reuse_payload_and_fit_the_training_pairs(trio: tuple) -> None:
    p, c, codec, maps = trio
    ids = _prompts(1, 48, seed=0)[0]  # a training prompt: the map's fit must beat the linear decoder's there
    ref = prefill_states(c, ids)
    payload = codec.encode(p, ids, patch=())
    k_lin, _ = codec.decode_layers(c, payload)
    k_map, v_map = decode_reuse(maps, codec, c, payload, ids[0].tolist())
    for i in range(2):
        assert k_map[i].shape == ref.k[i].shape and v_map[i].shape == ref.v[i].shape
        assert float((k_map[i] - ref.k[i]).norm()) < float((k_lin[i] - ref.k[i]).norm())


def test_maps_for_another_pair_or_codec_are_refused(trio: tuple, tmp_path: Path) -> None:
    p, c, codec, maps = trio
    maps.check(codec.producer_fp, codec.consumer_fp, codec.pair.hex())
    with pytest.raises(MapError, match="another consumer"):
        maps.check(codec.producer_fp, "0" * 64, codec.pair.hex())
    with pytest.raises(MapError, match="another producer"):
        maps.check("f" * 64, codec.consumer_fp, codec.pair.hex())
    other = calibrate_on(p, p, _prompts(), CalibrationConfig(rank_k=8, rank_v=8, rank_h=8, prefixes=8, length=48,
                                                              suffix=8, aligner_steps=0))
    ids = _prompts(1, 16, seed=2)[0]
    with pytest.raises(MapError, match="another consumer"):
        decode_reuse(maps, other, p, other.encode(p, ids, patch=()), ids[0].tolist())
    with pytest.raises(PayloadError, match="REUSE payloads"):
        decode_reuse(maps, codec, c, codec.encode(p, ids, patch=[0]), ids[0].tolist())
    path = maps.save(tmp_path / "maps.safetensors")
    back = KVMaps.load(path)
    assert back.identity() == maps.identity() and all(torch.equal(back.tensors[k], v) for k, v in maps.tensors.items())
    (tmp_path / "junk.safetensors").write_bytes(b"not a map")
    with pytest.raises(MapError, match="not a kvstate nonlinear-map file"):
        KVMaps.load(tmp_path / "junk.safetensors")
    with pytest.raises(MapError, match="no map for layer 5"):
        maps.apply(5, torch.zeros(1, 1), torch.zeros(1, 1))
    assert isinstance(codec, Codec)


def test_kl_tuning_lowers_the_consumers_kl_given_the_mapped_cache(trio: tuple) -> None:
    p, c, codec, _ = trio
    prompts = _prompts(4)

    def kl(m: KVMaps) -> float:
        tot = 0.0
        for ids in prompts:
            with torch.inference_mode():
                ref = prefill_states(c, ids).logits[40:]
                keys, values = decode_reuse(m, codec, c, codec.encode(p, ids[:, :40], patch=()), ids[0].tolist())
                tot += float(kl_div(ref, suffix_logits(c, keys, values, ids, 40)))
        return tot

    shrunk = train_kv_maps(p, c, codec, prompts, [0, 1], MapConfig(steps=0, ridge=0.3))  # a poor start: heavy ridge
    shrunk = replace(shrunk, config=MapConfig(steps=0, ridge=0.3, kl_steps=80, kl_lr=1e-3))
    tuned = kl_tune_kv_maps(shrunk, p, c, codec, prompts, suffix=8)
    assert kl(tuned) < 0.7 * kl(shrunk) and tuned.identity() == shrunk.identity()
