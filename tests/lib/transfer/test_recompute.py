"""Selective recompute against the consumer's own forward: given the consumer's true residual stream the
recomputed layer (and the next one, projected) reproduce its prefill K/V; a self-pair codec at full rank
decodes the consumer's cache; the profile keeps the layer of lowest KL; bad layers and payloads fail loudly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvstate.models.tiny import tiny_model
from kvstate.transfer import PayloadError
from kvstate.transfer import methods as registry
from kvstate.transfer.calibrate import CalibrationConfig, calibrate_on
from kvstate.transfer.codec import Codec, CodecError
from kvstate.transfer.methods import MethodContext, MethodError
from kvstate.transfer.nonlinear import MapConfig, train_kv_maps
from kvstate.transfer.payload import Payload
from kvstate.transfer.recompute import (
    RecomputeCodec,
    RecomputeConfig,
    calibrate_recompute,
    recompute_layer,
)
from kvstate.transfer.states import capture_inputs, continue_logits, prefill_states
from tests.lib.transfer.conftest import prompts as _prompts

LAYERS, HIDDEN, HEAD_DIM = 4, 64, 16



def _model(seed: int = 0, noise: float = 0.0) -> torch.nn.Module:
    m = tiny_model("qwen3", seed=seed, num_hidden_layers=LAYERS)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(noise * p.std() * torch.randn(p.shape, generator=g))
    return m



@pytest.fixture(scope="module")
def models() -> tuple[torch.nn.Module, torch.nn.Module]:
    return _model(), _model(noise=0.3)


@pytest.fixture(scope="module")
def self_codec(models: tuple) -> Codec:
    p, _ = models
    cfg = CalibrationConfig(rank_k=HEAD_DIM, rank_v=HEAD_DIM, rank_h=8, bits=32, prefixes=8, length=48, suffix=8,
                            aligner_steps=0)
    return calibrate_on(p, p, _prompts(), cfg)


@pytest.fixture(scope="module")
def pair_codec(models: tuple) -> Codec:
    p, c = models
    cfg = CalibrationConfig(rank_k=8, rank_v=8, rank_h=8, bits=8, prefixes=8, length=48, suffix=8, aligner_steps=0)
    return calibrate_on(p, c, _prompts(), cfg)


@pytest.mark.parametrize("layer", range(LAYERS))
def test_recomputed_layer_equals_the_consumers_own_forward(models: tuple, layer: int) -> None:
    _, c = models
    ids = _prompts(1, 40, seed=3)[0]
    ref = prefill_states(c, ids)
    with torch.inference_mode(), capture_inputs(c, "layer") as resid:
        c(input_ids=ids, position_ids=torch.arange(40)[None], use_cache=False)
    with torch.inference_mode():
        keys, values = recompute_layer(c, layer, resid[layer][0])
    assert len(keys) == min(2, LAYERS - layer)
    for j, (k, v) in enumerate(zip(keys, values, strict=True)):
        assert torch.allclose(k, ref.k[layer + j], atol=1e-5, rtol=1e-4)
        assert torch.allclose(v, ref.v[layer + j], atol=1e-5, rtol=1e-4)


def test_a_perturbed_stream_changes_the_recomputed_kv(models: tuple) -> None:
    """The reference above is not vacuous: another stream gives other K/V at both layers."""
    _, c = models
    ids = _prompts(1, 24, seed=4)[0]
    ref = prefill_states(c, ids)
    with torch.inference_mode(), capture_inputs(c, "layer") as resid:
        c(input_ids=ids, position_ids=torch.arange(24)[None], use_cache=False)
        keys, _ = recompute_layer(c, 1, resid[1][0] + 0.5 * torch.randn(resid[1][0].shape))
    assert not torch.allclose(keys[0], ref.k[1], atol=1e-3) and not torch.allclose(keys[1], ref.k[2], atol=1e-3)


@pytest.mark.parametrize("layer", [0, 1, 3])
def test_self_pair_codec_at_full_rank_decodes_the_consumers_cache(models: tuple, self_codec: Codec, layer: int) -> None:
    p, _ = models
    rc = calibrate_recompute(p, p, self_codec, _prompts(), rank=HIDDEN, bits=32,
                             map_cfg=MapConfig(steps=0, ridge=0.0), layers=[layer], suffix=8)
    assert rc.config.layer == layer and rc.modes[layer] == "C" and rc.recomputed_layers == 1
    ids = _prompts(1, 40, seed=5)[0]
    ref = prefill_states(p, ids)
    payload = Payload.from_bytes(rc.encode(p, ids[:, :32]).to_bytes())
    assert (f"b.{layer}.q" in payload.tensors) == (layer > 0)
    keys, values = rc.decode_layers(p, payload, ids[0].tolist())
    for i in range(LAYERS):
        assert torch.allclose(keys[i], ref.k[i][:32], atol=2e-3, rtol=1e-3), i
        assert torch.allclose(values[i], ref.v[i][:32], atol=2e-3, rtol=1e-3), i
    got = continue_logits(p, rc.decode(p, payload, ids[0].tolist()), ids, 32)
    assert torch.allclose(got, ref.logits[32:], atol=2e-3, rtol=1e-3)


def test_profile_keeps_the_layer_of_lowest_held_out_kl(models: tuple, pair_codec: Codec) -> None:
    p, c = models
    rc = calibrate_recompute(p, c, pair_codec, _prompts(), rank=32, map_cfg=MapConfig(steps=0), suffix=8)
    kl = {int(k): v for k, v in rc.info["kl_by_layer"].items()}
    assert sorted(kl) == list(range(LAYERS)) and rc.info["chosen"] == rc.config.layer
    assert kl[rc.config.layer] == min(kl.values()) and len(set(kl.values())) > 1
    assert sorted(rc.info["kl_mean_by_layer"]) == sorted(rc.info["kl_by_layer"])  # the median decides; the mean is kept


def test_recompute_layer_outside_the_consumer_is_refused(models: tuple, pair_codec: Codec) -> None:
    p, c = models
    with pytest.raises(CodecError, match=r"recompute layer 4 is outside the consumer's layers 0\.\.3"):
        RecomputeCodec(RecomputeConfig(LAYERS), pair_codec, {})
    with pytest.raises(CodecError, match="recompute layer 7 is outside"):
        calibrate_recompute(p, c, pair_codec, _prompts(), layers=[7])
    with pytest.raises(CodecError, match=r"RecomputeConfig\.layer"):
        RecomputeConfig(-1)


def test_payload_without_the_boundary_code_or_for_another_codec_is_refused(models: tuple, pair_codec: Codec,
                                                                         self_codec: Codec) -> None:
    p, c = models
    rc = calibrate_recompute(p, c, pair_codec, _prompts(), rank=16, map_cfg=MapConfig(steps=0), layers=[2], suffix=8)
    ids = _prompts(1, 24, seed=6)[0]
    payload = rc.encode(p, ids)
    rc.decode(c, payload, ids[0].tolist())  # the intact payload decodes
    stripped = Payload(payload.pair, payload.n_tokens, payload.token_hash,
                       {k: v for k, v in payload.tensors.items() if not k.startswith("b.")}, payload.meta)
    with pytest.raises(PayloadError, match=r"lacks the boundary code 'b\.2\.q'.*recomputes layer 2 from"):
        rc.decode(c, stripped, ids[0].tolist())
    other = calibrate_recompute(p, p, self_codec, _prompts(), rank=16, map_cfg=MapConfig(steps=0), layers=[2], suffix=8)
    with pytest.raises(PayloadError, match="model pair"):
        rc.decode(c, other.encode(p, ids, check=False), ids[0].tolist(), check=False)
    with pytest.raises(PayloadError, match="other tokens"):
        rc.decode(c, payload, [1] * 24)
    relayered = Payload(payload.pair, payload.n_tokens, payload.token_hash, payload.tensors,
                        {**payload.meta, "recompute": "1"})
    with pytest.raises(PayloadError, match="recompute layer 2"):
        rc.decode(c, relayered, ids[0].tolist())
    with pytest.raises(CodecError, match="another consumer"):
        rc.decode(p, payload, ids[0].tolist())


def test_saved_codec_round_trips_and_is_refused_for_another_pair(models: tuple, pair_codec: Codec,
                                                                 self_codec: Codec, tmp_path: Path) -> None:
    p, c = models
    maps = train_kv_maps(p, c, pair_codec, _prompts(), [0, 3], MapConfig(steps=20, hidden=16))
    rc = calibrate_recompute(p, c, pair_codec, _prompts(), rank=16, map_cfg=MapConfig(steps=20, hidden=16),
                             layers=[1], maps=maps, suffix=8)
    assert rc.modes == "ECJM"
    path = rc.save(tmp_path / "rc.safetensors")
    back = RecomputeCodec.load(path, pair_codec)
    assert back.pair == rc.pair and back.config == rc.config and back.modes == rc.modes
    ids = _prompts(1, 24, seed=7)[0]
    payload = rc.encode(p, ids)
    ka, _ = rc.decode_layers(c, payload, ids[0].tolist())
    kb, _ = back.decode_layers(c, payload, ids[0].tolist())
    assert all(torch.equal(x, y) for x, y in zip(ka, kb, strict=True))
    with pytest.raises(CodecError, match="calibrated for another SCD codec"):
        RecomputeCodec.load(path, self_codec)
    m = registry.get("scd_recompute_nonlinear")
    with pytest.raises(CodecError, match="calibrated for another SCD codec"):
        m.check(MethodContext(codec=self_codec, options={"artifact": str(path)}))
    with pytest.raises(MethodError, match="needs its trained artifact"):
        m.encode(p, ids, MethodContext(codec=pair_codec))
    with pytest.raises(MethodError, match="is not a scd_recompute codec"):  # a nonlinear artifact for the linear one
        registry.get("scd_recompute").check(MethodContext(codec=pair_codec, options={"artifact": str(path)}))
    assert m.recomputed_layers(MethodContext(codec=pair_codec, options={"artifact": str(path)})) == (1,)
