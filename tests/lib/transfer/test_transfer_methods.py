"""The transfer-method registry: one contract test over every registered method (encode -> wire -> decode,
bytes per token from the payload), the lossless methods against the consumer's own prefill, and the
registry's bad input (unknown name, option a method does not take, a duplicate name)."""

from __future__ import annotations

import pytest
import torch

from kvstate.models.tiny import tiny_model
from kvstate.transfer import PayloadError
from kvstate.transfer import methods as registry
from kvstate.transfer.calibrate import CalibrationConfig, calibrate_on
from kvstate.transfer.codec import Codec
from kvstate.transfer.methods import MethodContext, MethodError
from kvstate.transfer.payload import HEADER_BYTES, Payload
from kvstate.transfer.states import build_cache, continue_logits, prefill_states
from tests.lib.transfer.conftest import prompts as _prompts

LAYERS = 2  # the tiny qwen3 of kvstate.models.tiny




@pytest.fixture(scope="module")
def pair() -> tuple[torch.nn.Module, torch.nn.Module, Codec]:
    p, c = tiny_model("qwen3", seed=0), tiny_model("qwen3", seed=0)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # a 'fine-tuned' consumer: the producer's weights plus relative noise
        for w in c.parameters():
            w.add_(0.3 * w.std() * torch.randn(w.shape, generator=g))
    cfg = CalibrationConfig(rank_k=8, rank_v=8, rank_h=32, bits=8, prefixes=8, length=48, suffix=8,
                            aligner_steps=20, aligner_hidden=32, patch=1)
    return p, c, calibrate_on(p, c, _prompts(8), cfg)


@pytest.fixture(scope="module")
def self_codec() -> Codec:
    """Producer == consumer: a codec whose pair is one model twice (for the lossless methods)."""
    m = tiny_model("qwen3", seed=0)
    cfg = CalibrationConfig(rank_k=8, rank_v=8, rank_h=16, bits=8, prefixes=4, length=48, suffix=8, aligner_steps=0)
    return calibrate_on(m, m, _prompts(4), cfg)


def _cache_tensors(cache: object) -> list[torch.Tensor]:
    return [x for layer in cache.layers for x in (layer.keys, layer.values)]  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", registry.names())
def test_every_registered_method_round_trips_through_the_wire_format(pair: tuple, name: str) -> None:
    """The contract: options from its own profiling; encode -> bytes -> parse -> decode equals decoding the
    payload it encoded; the consumer's cache holds every prompt token at every layer, finite; bytes per token
    are the serialised payload over its tokens (tensors plus bounded framing); another prompt's ids are refused;
    the recomputed layers lie in the consumer's range."""
    p, c, codec = pair
    m = registry.get(name)
    ctx = MethodContext(codec=codec)
    opts, _info = m.profile(p, c, _prompts(1, 40, seed=21), ctx)
    ctx = ctx.with_options(**opts)
    m.check(ctx)
    rec = m.recomputed_layers(ctx)
    assert list(rec) == sorted(set(rec)) and all(0 <= i < LAYERS for i in rec)
    ids = _prompts(1, 40, seed=22)[0]
    prompt = ids[0].tolist()
    t = ids.shape[1] - 1
    if not m.ships_payload:  # the oracle: nothing on the wire, the consumer's own prefill
        with pytest.raises(MethodError, match="ships no payload"):
            m.encode(p, ids[:, :t], ctx)
        cache = m.decode(c, None, prompt, ctx)
        got = continue_logits(c, cache, ids, t)
        assert torch.allclose(got, prefill_states(c, ids).logits[t:], atol=1e-4)
        assert rec == tuple(range(LAYERS))
        return
    pl = m.encode(p, ids[:, :t], ctx)
    data = pl.to_bytes()
    back = Payload.from_bytes(data)
    assert back.to_bytes() == data and back.n_tokens == t and back.meta == pl.meta
    nbytes = registry.tensor_bytes(pl)
    assert registry.payload_bytes_per_token(pl) == len(data) / t
    assert nbytes < len(data) <= nbytes + HEADER_BYTES + 1024 + 160 * len(pl.tensors)  # framing is bounded
    a, b = m.decode(c, back, prompt, ctx), m.decode(c, pl, prompt, ctx)
    ta, tb = _cache_tensors(a), _cache_tensors(b)
    assert len(ta) == 2 * LAYERS and all(torch.equal(x, y) for x, y in zip(ta, tb, strict=True))
    assert all(x.shape[-2] == t and bool(torch.isfinite(x).all()) for x in ta)
    assert bool(torch.isfinite(continue_logits(c, a, ids, t)).all())
    # the library's two ends agree on the pair and decode the same
    pair_fp, encode = registry.encoder(name, p, ctx)
    rx = registry.receiver(name, c, ctx)
    assert pair_fp == rx.pair == pl.pair and encode(ids[:, :t]).to_bytes() == data
    assert all(torch.equal(x, y) for x, y in zip(_cache_tensors(rx.decode(back, prompt)), ta, strict=True))
    other = list(prompt)
    other[0] = (other[0] + 1) % 128
    with pytest.raises(PayloadError, match="other tokens"):
        m.decode(c, back, other, ctx)


@pytest.mark.parametrize("name", ["raw", "raw_fp32", "droidspeak"])
def test_lossless_methods_equal_the_oracle_for_one_model(self_codec: Codec, name: str) -> None:
    model = tiny_model("qwen3", seed=0)
    ctx = MethodContext(codec=self_codec, options={"block": "1:2"} if name == "droidspeak" else {})
    m = registry.get(name)
    ids = _prompts(1, 40, seed=16)[0]
    oracle = prefill_states(model, ids).logits[32:]
    pl = m.encode(model, ids[:, :32], ctx)
    got = continue_logits(model, m.decode(model, pl, None, ctx), ids, 32)
    assert torch.allclose(got, oracle, atol=1e-4 if name == "raw_fp32" else 2e-2)  # fp32 / fp16 on the wire
    if name == "droidspeak":
        assert "resid" in pl.tensors and "k.1" not in pl.tensors and "k.0" in pl.tensors
        assert m.recomputed_layers(ctx) == (1,)


@pytest.mark.parametrize("name", ["kivi4", "kivi2"])
def test_kivi_is_lossy_but_close_and_keeps_its_recent_window(self_codec: Codec, name: str) -> None:
    model = tiny_model("qwen3", seed=0)
    ctx = MethodContext(codec=self_codec)
    m = registry.get(name)
    ids = _prompts(1, 200, seed=17)[0]
    ps = prefill_states(model, ids)
    pl = m.encode(model, ids, ctx)
    cache = m.decode(model, pl, None, ctx)
    raw = build_cache(model, ps.k, ps.v)
    kq, kr = cache.layers[1].keys, raw.layers[1].keys  # (1, H, T, D); tokens 64.. are KIVI's fp16 residual
    err = float((kq[:, :, :64] - kr[:, :, :64]).abs().max())
    assert 0 < err < (0.25 if name == "kivi4" else 0.8) * float(kr.abs().max())
    assert float((kq[:, :, 64:] - kr[:, :, 64:]).abs().max()) < 1e-2 * float(kr.abs().max())
    wrong = Payload(b"\x01" * 32, pl.n_tokens, pl.token_hash, pl.tensors, pl.meta)
    with pytest.raises(PayloadError, match="model pair"):
        m.decode(model, wrong, None, ctx)
    with pytest.raises(PayloadError, match="encoded by method"):  # a raw payload handed to a KIVI consumer
        m.decode(model, registry.get("raw").encode(model, ids, ctx), None, ctx)


def test_droidspeak_profiles_every_contiguous_block_and_picks_the_smallest_within_its_bound(pair: tuple) -> None:
    from kvstate.transfer.methods.droidspeak import choose_block, profile_blocks

    p, c, codec = pair
    kl = profile_blocks(p, c, _prompts(2, 40, seed=18), MethodContext(codec=codec), suffix=8)
    assert set(kl) == {(0, 0), (0, 1), (0, 2), (1, 2)} and kl[(0, 0)] > 0
    assert kl[(0, 2)] < 0.5 * kl[(0, 0)]  # every layer recomputed (from the producer's embeddings) beats raw reuse
    assert choose_block({(0, 0): 1.0, (0, 1): 0.5, (1, 2): 0.2, (0, 2): 0.0}, keep=0.25) == (1, 2)
    assert choose_block({(0, 0): 1.0, (0, 1): 0.5, (1, 2): 0.3, (0, 2): 0.1}, keep=0.25) == (0, 2)
    assert choose_block({(0, 0): 1.0, (0, 1): 0.5, (1, 2): 0.3, (0, 2): 0.4}, keep=0.25) == (0, 2)


def test_the_registry_refuses_unknown_names_foreign_options_and_duplicates(pair: tuple) -> None:
    _, _, codec = pair
    with pytest.raises(MethodError) as e:
        registry.get("zip")
    assert str(e.value).startswith("--method 'zip' is not a transfer method; pick one of ")
    assert all(n in str(e.value) for n in registry.names()) and "\n" not in str(e.value)
    with pytest.raises(MethodError, match="ships no payload"):
        registry.encoder("oracle", None, MethodContext(codec=codec))
    with pytest.raises(MethodError, match="takes no option block"):
        registry.get("kivi4").check(MethodContext(codec=codec, options={"block": "0:1"}))
    for bad in ("x", "2:1", "0:99", "1"):
        with pytest.raises(MethodError, match="block"):
            registry.get("droidspeak").check(MethodContext(codec=codec, options={"block": bad}))
    with pytest.raises(MethodError, match="patch"):
        registry.get("scd").check(MethodContext(codec=codec, options={"patch": "0,7"}))
    with pytest.raises(MethodError, match="already registered"):
        registry.register(type(registry.get("raw"))(name="raw", order=99))
    with pytest.raises(MethodError, match="KEY=VALUE"):
        registry.parse_options(["block"])
    assert registry.parse_options(["block=1:2", "patch= 0 "]) == {"block": "1:2", "patch": "0"}
    ds = registry.get("droidspeak")  # two blocks never share a store key
    assert ds.variant(MethodContext(codec=codec, options={"block": "1:2"})) != ds.variant(MethodContext(codec=codec))


def test_bench_rows_have_unique_names_and_the_table_order(pair: tuple) -> None:
    _, _, codec = pair
    ctx = MethodContext(codec=codec, pca_codec=codec)
    rows = [r for m in registry.methods() for r in m.bench_rows(ctx)]
    assert len(rows) == len(set(rows)) and rows[0] == "oracle"
    assert rows[:6] == ["oracle", "raw", "raw_fp32", "kivi4", "kivi2", "droidspeak"]
    assert {"reuse_pca_producer", "reuse", "scd", "scd_k1", "scd_k2"} <= set(rows)
    k2 = registry.get("scd").bench_rows(ctx)["scd_k2"]
    assert k2.option("patch") == "0,1"


def test_serving_a_transfer_needs_no_lab() -> None:
    """The library's serve / generate / methods commands and every registered method import nothing from the lab."""
    import subprocess
    import sys

    code = ("import sys, typer; import kvstate.transfer.cli as c; from kvstate.transfer import methods as m; "
            "m.names(); c.register_commands(typer.Typer()); "
            "print(sorted(k for k in sys.modules if k.startswith('kvstate.lab')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
