"""SCD codec against oracles: full-rank REUSE reproduces the producer's K/V, PATCH everywhere equals the
consumer's own prefill, mismatched pairs fail loudly (the baselines: tests/lib/transfer/test_transfer_methods.py)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import DynamicCache

from kvstate.errors import IntegrityError, OutputError
from kvstate.models.tiny import tiny_model
from kvstate.transfer import PayloadError
from kvstate.transfer.calibrate import CalibrationConfig, calibrate_on
from kvstate.transfer.codec import Codec, CodecConfig, CodecError
from kvstate.transfer.states import build_cache, continue_logits, prefill_states
from tests.lib.transfer.conftest import prompts as _prompts

HIDDEN, HEAD_DIM, LAYERS = 64, 16, 2  # the tiny qwen3 of kvstate.models.tiny



def _perturbed(scale: float) -> torch.nn.Module:
    """A 'fine-tuned' consumer: the producer's weights plus relative noise."""
    m = tiny_model("qwen3", seed=0)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(scale * p.std() * torch.randn(p.shape, generator=g))
    return m



@pytest.fixture(scope="module")
def producer() -> torch.nn.Module:
    return tiny_model("qwen3", seed=0)


@pytest.fixture(scope="module")
def self_codec(producer: torch.nn.Module) -> Codec:
    """Producer == consumer, every rank full, fp32 codes: decoding must be exact."""
    cfg = CalibrationConfig(rank_k=HEAD_DIM, rank_v=HEAD_DIM, rank_h=HIDDEN, bits=32, prefixes=8, length=48,
                            suffix=8, aligner_steps=20, aligner_hidden=32)
    return calibrate_on(producer, producer, _prompts(), cfg)


@pytest.fixture(scope="module")
def pair() -> tuple[torch.nn.Module, torch.nn.Module, Codec]:
    p, c = tiny_model("qwen3", seed=0), _perturbed(0.3)
    cfg = CalibrationConfig(rank_k=8, rank_v=8, rank_h=HIDDEN, bits=8, prefixes=16, length=48, suffix=8,
                            aligner_steps=150, aligner_hidden=64)
    return p, c, calibrate_on(p, c, _prompts(16), cfg)


def test_full_rank_reuse_reproduces_producer_kv(producer: torch.nn.Module, self_codec: Codec) -> None:
    ids = _prompts(1, 40, seed=9)[0]
    ref = prefill_states(producer, ids)
    keys, values = self_codec.decode_layers(producer, self_codec.encode(producer, ids, patch=()))
    for i in range(LAYERS):
        assert torch.allclose(keys[i], ref.k[i], atol=1e-4, rtol=1e-4)
        assert torch.allclose(values[i], ref.v[i], atol=1e-4, rtol=1e-4)


def test_full_rank_pca_reuse_ships_the_producer_kv_to_another_consumer(pair: tuple) -> None:
    p, c, _ = pair
    cfg = CalibrationConfig(rank_k=HEAD_DIM, rank_v=HEAD_DIM, rank_h=8, bits=32, prefixes=4, length=48, suffix=8,
                            aligner_steps=0, reuse_map="pca")
    codec = calibrate_on(p, c, _prompts(4), cfg)
    ids = _prompts(1, 24, seed=18)[0]
    ref = prefill_states(p, ids)
    keys, values = codec.decode_layers(c, codec.encode(p, ids, patch=()))
    assert all(torch.allclose(a, b, atol=1e-4) for a, b in zip(keys + values, ref.k + ref.v, strict=True))
    with pytest.raises(CodecError, match="reuse_map"):
        CalibrationConfig(reuse_map="other")
    with pytest.raises(CodecError, match="patch_map"):
        CalibrationConfig(patch_map="pca")


def test_patch_at_every_layer_equals_the_consumer_oracle(producer: torch.nn.Module, self_codec: Codec) -> None:
    ids = _prompts(1, 40, seed=10)[0]
    oracle = prefill_states(producer, ids).logits[30:]
    payload = self_codec.encode(producer, ids[:, :30], patch=range(LAYERS))
    assert payload.meta["modes"] == "PP" and not any(k.startswith(("k.", "v.")) for k in payload.tensors)
    got = continue_logits(producer, self_codec.decode(producer, payload, ids[0].tolist()), ids, 30)
    assert torch.allclose(got, oracle, atol=1e-3, rtol=1e-3)


def test_patch_moves_a_drifted_consumer_towards_its_oracle(pair: tuple) -> None:
    p, c, codec = pair
    ids = _prompts(1, 48, seed=11)[0]
    cs = prefill_states(c, ids)
    oracle = cs.logits[40:]

    def dist(cache: DynamicCache) -> float:
        return float((continue_logits(c, cache, ids, 40) - oracle).abs().mean())

    ps = prefill_states(p, ids[:, :40])
    raw = dist(build_cache(c, ps.k, ps.v))
    patched = dist(codec.decode(c, codec.encode(p, ids[:, :40], patch=range(LAYERS))))
    assert patched < 0.85 * raw
    info = codec.info
    assert len(info["raw_drift_k"]) == LAYERS and all(x > 0 for x in info["raw_drift_k"])
    assert info["kl_all_layers"]["patch_all"] < info["kl_all_layers"]["raw"]


def test_int4_codes_shrink_the_payload_and_still_decode(pair: tuple) -> None:
    p, c, codec = pair
    ids = _prompts(1, 32, seed=12)[0]
    b8, b4 = codec.encode(p, ids, bits=8), codec.encode(p, ids, bits=4)
    assert len(b4.to_bytes()) < 0.75 * len(b8.to_bytes())
    k8, _ = codec.decode_layers(c, b8)
    k4, _ = codec.decode_layers(c, b4)
    assert all(float((a - b).abs().max()) < 0.5 * float(a.abs().max()) for a, b in zip(k8, k4, strict=True))


def test_mismatched_pair_and_bad_config_raise(producer: torch.nn.Module, self_codec: Codec, pair: tuple) -> None:
    p, c, codec = pair
    ids = _prompts(1, 20, seed=13)[0]
    with pytest.raises(CodecError, match="another consumer"):
        self_codec.decode(c, self_codec.encode(producer, ids))
    with pytest.raises(CodecError, match="another producer"):
        codec.encode(c, ids)
    with pytest.raises(PayloadError, match="model pair"):
        codec.decode(c, self_codec.encode(producer, ids), check=False)
    with pytest.raises(PayloadError, match="other tokens"):
        codec.decode(c, codec.encode(p, ids), token_ids=[1] * 20)
    with pytest.raises(CodecError, match="head dimension"):
        CalibrationConfig(rank_k=HEAD_DIM + 1, prefixes=4, length=48, suffix=8) and calibrate_on(
            p, c, _prompts(4), CalibrationConfig(rank_k=HEAD_DIM + 1, prefixes=4, length=48, suffix=8))
    with pytest.raises(CodecError, match="out of range"):
        codec.encode(p, ids, patch=[LAYERS])
    with pytest.raises(CodecError, match="out of range"):
        CodecConfig(4, 4, 4, (7,)).check(codec.geometry)


@pytest.mark.parametrize("reuse_map", ["regress", "joint"])
def test_truncated_codec_is_the_lower_rank_fit(pair: tuple, reuse_map: str) -> None:
    """Regression: the truncation is the lower-rank fit. Joint: the same principal code (encoder), decoded by
    the larger fit's orthogonal rows (still a scaled orthogonal map, not a refit)."""
    p, c, _ = pair
    kw = {"rank_h": 8, "bits": 32, "prefixes": 4, "length": 48, "suffix": 8, "aligner_steps": 0, "patch": 0,
          "reuse_map": reuse_map}
    big = calibrate_on(p, c, _prompts(4), CalibrationConfig(rank_k=8, rank_v=12, **kw))
    small = calibrate_on(p, c, _prompts(4), CalibrationConfig(rank_k=3, rank_v=5, **kw))
    cut = big.truncated(3, 5)
    for name in ("k.1.enc", "v.0.enc") if reuse_map == "joint" else ("k.1.enc", "k.1.dec", "v.0.enc", "v.0.dec"):
        assert torch.allclose(cut.tensors[name].abs(), small.tensors[name].abs(), atol=1e-4)  # SVD signs
    if reuse_map == "joint":
        dec = cut.tensors["v.0.dec"][0]  # (5, D): rows orthogonal with one common norm
        gram = dec @ dec.T
        assert torch.allclose(gram, gram[0, 0] * torch.eye(5), atol=1e-4 * float(gram[0, 0]))
    with pytest.raises(CodecError, match="ranks"):
        big.truncated(9, 1)


def test_save_load_round_trip(tmp_path, pair: tuple) -> None:  # type: ignore[no-untyped-def]
    p, c, codec = pair
    codec.save(tmp_path / "codec")
    back = Codec.load(tmp_path / "codec")
    assert back.pair == codec.pair and back.config == codec.config
    ids = _prompts(1, 24, seed=14)[0]
    k1, _ = codec.decode_layers(c, codec.encode(p, ids))
    k2, _ = back.decode_layers(c, back.encode(p, ids))
    assert all(torch.equal(a, b) for a, b in zip(k1, k2, strict=True))
    assert sorted(x.name for x in (tmp_path / "codec").iterdir()) == ["codec.safetensors", "manifest.json"]
    with pytest.raises(CodecError, match="not a codec directory"):
        Codec.load(tmp_path)


@pytest.mark.parametrize("damage", ["truncate", "flip", "manifest"])
def test_a_damaged_codec_file_is_one_integrity_error_naming_it(tmp_path, pair: tuple, damage: str) -> None:
    _, _, codec = pair
    codec.save(tmp_path / "codec")
    name = "manifest.json" if damage == "manifest" else "codec.safetensors"
    path = tmp_path / "codec" / name
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2] if damage != "flip" else raw[:-1] + bytes([raw[-1] ^ 0xFF]))
    with pytest.raises(IntegrityError, match=rf"{name}.*kvstate transfer calibrate") as err:
        Codec.load(tmp_path / "codec")
    assert str(path) in str(err.value)


def test_the_pair_hashes_the_manifest_not_only_the_tensors(tmp_path, pair: tuple) -> None:
    _, _, codec = pair
    c = codec.config
    other_bits = Codec(CodecConfig(c.rank_k, c.rank_v, c.rank_h, c.patch_layers, 4), codec.geometry,
                       codec.producer_fp, codec.consumer_fp, codec.tensors, codec.info)
    assert other_bits.pair != codec.pair  # same tensors, another code precision: another codec
    codec.save(tmp_path / "codec")
    (tmp_path / "codec" / "eval.json").write_text("{}")
    manifest = tmp_path / "codec" / "manifest.json"
    m = json.loads(manifest.read_text())
    assert m["kind"] == "codec" and m["pair"] == codec.pair.hex()
    assert m["files"]["codec.safetensors"]["sha256"] == m["weights_sha256"]
    codec.save(tmp_path / "codec")  # a re-save keeps the files beside it
    assert (tmp_path / "codec" / "eval.json").is_file()
    manifest.write_text(json.dumps({**m, "bits": 4}))  # checksums still hold, the description does not
    with pytest.raises(CodecError, match=r"does not describe codec\.safetensors"):
        Codec.load(tmp_path / "codec")
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "thesis.txt").write_text("keep me")
    with pytest.raises(OutputError, match="is not a codec directory"):
        codec.save(notes)
    assert [p.name for p in notes.iterdir()] == ["thesis.txt"]


def test_generate_continues_a_decoded_cache(producer: torch.nn.Module, self_codec: Codec) -> None:
    ids = _prompts(1, 30, seed=15)[0]
    cache = self_codec.decode(producer, self_codec.encode(producer, ids[:, :-1]))
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, output_scores=True, return_dict_in_generate=True,
              attention_mask=torch.ones_like(ids))  # ids may hold a pad id: never masked
    got = producer.generate(ids, cache=cache, **kw)
    ref = producer.generate(ids, **kw)
    a, b = torch.stack(got.scores, 1), torch.stack(ref.scores, 1)  # (1, 6, V); -inf where EOS is banned
    finite = torch.isfinite(b)
    assert torch.equal(torch.isfinite(a), finite) and float((a[finite] - b[finite]).abs().max()) < 1e-4
    assert torch.equal(got.sequences, ref.sequences)


def _related_consumer(producer: torch.nn.Module, key_scale: float = 1.6) -> tuple[torch.nn.Module, list]:
    """A consumer computing the same function whose keys are ``key_scale`` x the producer's and whose values
    are the producer's rotated per KV head (q_norm / o_proj compensate): a known linear relation per head."""
    c = tiny_model("qwen3", seed=0)
    c.load_state_dict(producer.state_dict())
    g = torch.Generator().manual_seed(3)
    rots = []
    with torch.no_grad():
        for layer in c.model.layers:
            a = layer.self_attn
            a.k_norm.weight.mul_(key_scale)
            a.q_norm.weight.div_(key_scale)
            heads, kv = c.config.num_attention_heads, c.config.num_key_value_heads
            r = [torch.linalg.qr(torch.randn(HEAD_DIM, HEAD_DIM, generator=g))[0] for _ in range(kv)]
            w = a.v_proj.weight.view(kv, HEAD_DIM, -1)  # v = W h per head: v' = R v
            a.v_proj.weight.copy_(torch.stack([r[h] @ w[h] for h in range(kv)]).view_as(a.v_proj.weight))
            o = a.o_proj.weight.view(-1, heads, HEAD_DIM)  # o reads v' through R^T
            o.copy_(torch.stack([o[:, q] @ r[q // (heads // kv)].T for q in range(heads)], 1))
            rots.append(r)
    return c, rots


def test_joint_reuse_maps_a_known_linear_relation_exactly_at_full_rank(producer: torch.nn.Module) -> None:
    consumer, rots = _related_consumer(producer)
    ids = _prompts(1, 40, seed=11)[0]
    ps, cs = prefill_states(producer, ids), prefill_states(consumer, ids)
    assert torch.allclose(cs.logits, ps.logits, atol=1e-4)  # same function, other K/V
    assert torch.allclose(cs.v[0][:, 1], ps.v[0][:, 1] @ rots[0][1].T, atol=1e-5)
    assert not torch.allclose(cs.v[0], ps.v[0], atol=1e-2)
    cfg = CalibrationConfig(rank_k=HEAD_DIM, rank_v=HEAD_DIM, rank_h=HIDDEN, bits=32, prefixes=8, length=48,
                            suffix=8, aligner_steps=5, aligner_hidden=8, patch=0)
    codec = calibrate_on(producer, consumer, _prompts(), cfg)
    keys, values = codec.decode_layers(consumer, codec.encode(producer, ids[:, :-1]))
    for i in range(LAYERS):
        assert torch.allclose(keys[i], cs.k[i][:-1], atol=1e-4) and torch.allclose(values[i], cs.v[i][:-1], atol=1e-4)
    regress = calibrate_on(producer, consumer, _prompts(), CalibrationConfig(**{**cfg.__dict__, "reuse_map": "pca"}))
    _, pv = regress.decode_layers(consumer, regress.encode(producer, ids[:, :-1]))
    assert not torch.allclose(pv[0], cs.v[0][:-1], atol=1e-2)  # the producer-space ablation ships the producer's V


@pytest.mark.parametrize("patch_map", ["regress", "joint"])
def test_patch_at_every_layer_equals_another_consumers_own_prefill_on_logits(producer: torch.nn.Module,
                                                                             patch_map: str) -> None:
    """A consumer with other K/V (but the same H_in): PATCH rebuilds its K/V with its own projections, so its
    logits after the patched cache equal its own prefill's, while raw producer K/V do not."""
    consumer, _ = _related_consumer(producer)
    ids = _prompts(1, 40, seed=12)[0]
    oracle = prefill_states(consumer, ids).logits[30:]
    cfg = CalibrationConfig(rank_k=HEAD_DIM, rank_v=HEAD_DIM, rank_h=HIDDEN, bits=32, prefixes=8, length=48,
                            suffix=8, aligner_steps=20, aligner_hidden=16, patch=LAYERS, patch_map=patch_map)
    codec = calibrate_on(producer, consumer, _prompts(), cfg)
    assert codec.config.patch_layers == tuple(range(LAYERS))
    # the gain is measured where the codec patches: one layer PATCHed, REUSE at the others
    pic, reuse = codec.info["patch_in_context"], codec.info["kl_all_layers"]["reuse"]
    assert len(pic) == LAYERS and codec.info["patch_gain"] == [round(max(0.0, reuse - p), 6) for p in pic]
    got = continue_logits(consumer, codec.decode(consumer, codec.encode(producer, ids[:, :30]), ids[0].tolist()), ids, 30)
    assert torch.allclose(got, oracle, atol=1e-3, rtol=1e-3)
    ps = prefill_states(producer, ids[:, :30])
    raw = continue_logits(consumer, build_cache(consumer, ps.k, ps.v), ids, 30)
    assert not torch.allclose(raw, oracle, atol=1e-2)


def test_a_consumer_changed_since_calibration_is_one_clear_error(pair: tuple) -> None:
    p, _, codec = pair
    changed = _perturbed(0.3)
    ids = _prompts(1, 20, seed=14)[0]
    payload = codec.encode(p, ids)
    codec.decode(changed, payload)  # the same weights: accepted
    with torch.no_grad():
        changed.model.layers[0].mlp.down_proj.weight[0, 0] += 1e-3  # one weight moved after calibration
    with pytest.raises(CodecError, match="consumer's weights changed since calibration"):
        codec.decode(changed, payload)
