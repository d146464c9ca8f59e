"""Post-hoc cross-layer KV sharing on the real model's tasks: the identity pattern is the unmodified model, a shared
layer reads its source's K/V (a written-out reference), the 30-layer plan, and the item-major driver on a tiny Llama."""

from __future__ import annotations

import json
import random

import pytest
import torch

from kvstate.depth.attention import layer_specs
from kvstate.depth.patterns import LayerSpec, SharingPattern, format_pattern, none
from kvstate.depth.sharing import apply_sharing
from kvstate.lab.depth import realmodel as rm
from kvstate.models.tiny import tiny_model
from tests.lab.models.test_real_model import MODEL, needs_model

TOL = 1e-4


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama", seed=1, num_hidden_layers=4)


def _ids(t=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 120, (1, t), generator=g)


@torch.inference_mode()
def test_every_layer_on_its_own_kv_reproduces_the_unmodified_model(llama):
    ids = _ids()
    base = llama(ids).logits  # (1, T, V)
    with apply_sharing(llama, none(layer_specs(llama.config))):
        same = llama(ids).logits
        gen = llama.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    ref = llama.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert (same - base).abs().max().item() <= TOL and torch.equal(gen, ref)


def _rope(x, theta):  # (B, H, T, D), positions 0..T-1: RoPE written out (rotate-half convention)
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = torch.arange(x.shape[2], dtype=torch.float32)[:, None] * inv[None]  # (T, D/2)
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    half = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * cos + half * sin


def _layer_by_hand(model, i, h, h_kv, j):
    """Decoder layer ``i`` on residual input ``h`` attending to the K/V layer ``j`` makes from its input ``h_kv``."""
    cfg, layers = model.config, model.model.layers
    H, KVH, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    theta = cfg.rope_parameters["rope_theta"]
    B, T, _ = h.shape
    x = layers[i].input_layernorm(h)
    x_kv = layers[j].input_layernorm(h_kv)
    a, src = layers[i].self_attn, layers[j].self_attn
    q = _rope(a.q_proj(x).view(B, T, H, D).transpose(1, 2), theta)  # (B, H, T, D)
    k = _rope(src.k_proj(x_kv).view(B, T, KVH, D).transpose(1, 2), theta)  # (B, KVH, T, D)
    v = src.v_proj(x_kv).view(B, T, KVH, D).transpose(1, 2)
    k, v = k.repeat_interleave(H // KVH, 1), v.repeat_interleave(H // KVH, 1)  # (B, H, T, D)
    s = q @ k.transpose(-1, -2) / D ** 0.5
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    o = (s.softmax(-1) @ v).transpose(1, 2).reshape(B, T, H * D)
    h = h + a.o_proj(o)
    return h + layers[i].mlp(layers[i].post_attention_layernorm(h))


def _trace(model, ids):
    """Residual input of every decoder layer and the output of each, from one forward."""
    ins, outs, hooks = {}, {}, []
    for i, layer in enumerate(model.model.layers):
        hooks.append(layer.register_forward_pre_hook(
            lambda _m, args, kwargs, i=i: ins.__setitem__(i, (args[0] if args else kwargs["hidden_states"]).clone()),
            with_kwargs=True))
        hooks.append(layer.register_forward_hook(
            lambda _m, _a, out, i=i: outs.__setitem__(i, (out[0] if isinstance(out, tuple) else out).clone())))
    try:
        model(ids, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return ins, outs


@torch.inference_mode()
def test_a_shared_layer_reads_its_source_kv_as_a_written_out_reference(llama):
    ids = _ids()
    base_in, base_out = _trace(llama, ids)
    # the reference itself is right: layer 2 on its own K/V by hand is the unmodified layer 2
    assert (_layer_by_hand(llama, 2, base_in[2], base_in[2], 2) - base_out[2]).abs().max().item() <= 1e-5
    pattern = SharingPattern((0, 1, 1, 3))  # layer 2 reads layer 1's K/V
    with apply_sharing(llama, pattern):
        ins, outs = _trace(llama, ids)
    shared = _layer_by_hand(llama, 2, ins[2], ins[1], 1)
    own = _layer_by_hand(llama, 2, ins[2], ins[2], 2)
    assert (ins[2] - base_in[2]).abs().max().item() <= 1e-6  # layers 0 and 1 are unchanged by the pattern
    assert (outs[2] - shared).abs().max().item() <= 1e-5
    assert (outs[2] - own).abs().max().item() > 1e-3  # the pattern changed what layer 2 reads


SMOL = [LayerSpec("full_attention", 3, 64)] * 30


def test_the_30_layer_plan_maps_each_family_and_keep_as_documented():
    rows = rm.plan(SMOL)
    got = {r.label: r for r in rows}
    owners = {k: len(r.pattern.owners) for k, r in got.items()}
    assert owners == {"keep@0.75": 22, "keep@0.5": 15, "keep@0.25": 7, "cla@0.5": 15, "cla@0.25": 8,
                      "top_shared@0.75": 22, "top_shared@0.5": 15, "top_shared@0.25": 7,
                      "rcla@0.75": 22, "rcla@0.5": 15, "rcla@0.25": 7}
    assert all(r.pattern.validate(SMOL) is r.pattern and r.pattern != none(SMOL) for r in rows)
    assert format_pattern(got["cla@0.5"].pattern) == "_".join(str(i - i % 2) for i in range(30))
    assert format_pattern(got["cla@0.25"].pattern) == "_".join(str(i - i % 4) for i in range(30))
    assert got["top_shared@0.5"].pattern.sources == (*range(15), *[14] * 15)
    assert got["keep@0.5"].pattern == got["cla@0.5"].pattern  # on 30 layers CLA2 is the spread keep-0.5 pattern
    assert rm.unique(rows)["cla@0.5"] == "keep@0.5" and rm.unique(rows)["keep@0.5"] == "keep@0.5"
    assert rm.plan(SMOL, draw_seed=0) == rows and rm.plan(SMOL, draw_seed=1)[-2].pattern != got["rcla@0.5"].pattern
    assert [r.label for r in rm.reduced(rows)] == ["keep@0.75", "keep@0.5", "keep@0.25", "cla@0.5", "top_shared@0.5",
                                                   "rcla@0.5"]


def test_an_rcla_draw_has_the_kept_owner_count_and_reads_only_earlier_owners():
    rng = random.Random(3)
    for keep in (0.75, 0.5, 0.25):
        p = rm.rcla_draw(SMOL, keep, rng)
        assert len(p.owners) == rm.kept_owners(SMOL, keep)
        assert all(s <= i and p.is_owner(s) for i, s in enumerate(p.sources))


@needs_model
@torch.inference_mode()
def test_the_driver_scores_every_pattern_per_item_and_writes_the_table(tmp_path):
    from kvstate.lab.experiment import run_items
    from kvstate.models.loading import load_tokenizer

    tok = load_tokenizer(MODEL)
    model = tiny_model("llama", seed=2, num_hidden_layers=4, vocab_size=len(tok), max_position_embeddings=1024)
    layers = layer_specs(model.config)
    rows = rm.plan(layers)
    e = rm.experiment(MODEL, rows, ("niah_single",), (256,), 2, 5, 8, 0)
    seen = []
    measure = rm.Measure(model, tok, rows, 8, seen.append)
    out = tmp_path / "pilot.json"
    doc = run_items(e, measure, out=out, appendix=lambda j: {"summary": rm.summary(e, [
        {"task": r["task"], "length": r["length"], **j.get(f"{r['seed']}/{r['length']}/{r['task']}/{r['index']}")}
        for r in [{"seed": 5, "length": 256, "task": "niah_single", "index": i} for i in range(2)]])})
    assert len(seen) == 2 and len(measure.seconds) == 2
    recs = doc["items"]
    assert all(set(r["scores"]) == {rm.FULL, *(x.label for x in rows)} for r in recs)
    assert all(r["extra"]["cla@0.5"] == {"same_as": "keep@0.5"} for r in recs)  # 0_0_2_2 both: run once
    replies = {r["extra"][rm.FULL]["reply"] for r in recs} | {r["extra"]["keep@0.25"]["reply"] for r in recs}
    assert len(replies) > 2  # sharing changes what the tiny model says
    saved = json.loads(out.read_text())["runs"][-1]
    s = saved["appendix"]["summary"]
    assert {r["method"] for r in s["rows"]} == set(e.methods) and s["closest_at_0.5"]["method"].endswith("@0.5")
    assert saved["provenance"]["seeds"] == [5] and "src/kvstate/lab/depth/realmodel.py" in saved["provenance"]["executed"]["files"]


@needs_model
@torch.inference_mode()
def test_on_the_real_model_the_identity_pattern_is_the_model_and_one_shared_top_layer_is_not():
    from kvstate.models.loading import load_model

    model = load_model(MODEL, torch.float32)
    layers = layer_specs(model.config)
    ids = torch.randint(100, 20000, (1, 48), generator=torch.Generator().manual_seed(0))
    base = model(ids).logits  # (1, T, V)
    with apply_sharing(model, none(layers)):
        same = model(ids).logits
    with apply_sharing(model, SharingPattern((*range(29), 28))):  # layer 29 reads layer 28's K/V
        top = model(ids).logits
    assert (same - base).abs().max().item() <= TOL and (top - base).abs().max().item() > 1e-3
