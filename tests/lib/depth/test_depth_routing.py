"""Stochastic KV routing as the paper describes it: the draw's distribution, a written-out reference forward,
resumable draws, use inside plain PyTorch and transformers.Trainer loops, and bad input."""

from __future__ import annotations

import itertools
import json
import math
import random
from collections import Counter

import pytest
import torch
from scipy.stats import binomtest, chisquare

from kvstate.depth.attention import layer_specs, routed
from kvstate.depth.patterns import (
    LayerSpec,
    PatternError,
    SharingPattern,
    draw_pattern,
    draw_route,
    format_pattern,
)
from kvstate.depth.routing import StochasticKVRouting
from kvstate.errors import UnsupportedModelError
from kvstate.models.tiny import tiny_model

F, S, R = LayerSpec("full_attention", 2, 16), LayerSpec("sliding_attention", 2, 16), LayerSpec("recurrent")
F1 = LayerSpec("full_attention", 1, 16)
TOL = 1e-5


def paper_probabilities(layers: list[LayerSpec], p: float) -> dict[tuple[int, ...], float]:
    """Exact route probabilities by enumeration, written from the paper's rule: an attention layer keeps its own
    K/V with probability p, else reads one of the earlier layers of its group, each with (1 - p) / count."""
    choices = []
    for i, spec in enumerate(layers):
        if not spec.is_attention:
            choices.append([(i, 1.0)])
            continue
        earlier = [j for j in range(i) if layers[j].is_attention and layers[j].group == spec.group]
        if not earlier:
            choices.append([(i, 1.0)])
        else:
            choices.append([(i, p)] + [(j, (1 - p) / len(earlier)) for j in earlier])
    out = {}
    for combo in itertools.product(*choices):
        out[tuple(s for s, _ in combo)] = math.prod(q for _, q in combo)
    return out


def _chi2(draws: list[SharingPattern], exact: dict[tuple[int, ...], float]) -> float:
    seen = Counter(d.sources for d in draws)
    assert set(seen) <= set(exact), set(seen) - set(exact)  # no impossible route was drawn
    keys = sorted(exact)
    return float(chisquare([seen[k] for k in keys], [exact[k] * len(draws) for k in keys]).pvalue)


def test_paper_draw_matches_the_enumerated_distribution():
    layers, p, n = [F, F, F, F], 0.5, 20_000
    exact = paper_probabilities(layers, p)
    assert len(exact) == 24 and math.isclose(exact[(0, 0, 0, 0)], 1 / 48) and math.isclose(sum(exact.values()), 1.0)
    rng = random.Random(2024)
    draws = [draw_route(layers, p, rng) for _ in range(n)]
    assert _chi2(draws, exact) > 1e-3
    zero = sum(d.sources == (0, 0, 0, 0) for d in draws)
    ci = binomtest(zero, n).proportion_ci(method="wilson")
    assert ci.low <= 1 / 48 <= ci.high, (zero / n, ci)
    # the owner variant is a different distribution, and the same test tells them apart
    owner = [draw_pattern(layers, p, random.Random(7 + k)) for k in range(n // 4)]
    assert _chi2(owner, exact) < 1e-6


@pytest.mark.parametrize("layers", [[F, S, F, S, S], [R, F, R, F, F], [F, F1, F, F1, F]], ids=["mixed", "hybrid", "shapes"])
def test_paper_draw_stays_within_groups(layers):
    exact = paper_probabilities(layers, 0.4)
    rng = random.Random(5)
    draws = [draw_route(layers, 0.4, rng) for _ in range(4000)]
    for d in draws:
        d.validate(layers, require_owners=False)
    assert _chi2(draws, exact) > 1e-3


def test_owner_rule_is_what_it_says():
    layers, n = [F, F, F, F], 20_000
    rng = random.Random(11)
    draws = [draw_pattern(layers, 0.5, rng) for _ in range(n)]
    zero = sum(d.sources == (0, 0, 0, 0) for d in draws)
    ci = binomtest(zero, n).proportion_ci(method="wilson")
    assert ci.low <= 1 / 8 <= ci.high, (zero / n, ci)
    assert all(d.validate(layers) for d in draws)  # every owner draw is a deployable pattern
    paper = [draw_route(layers, 0.5, rng) for _ in range(200)]
    assert any(not _owner_valid(d, layers) for d in paper)  # the paper's routes are not all deployable


def _owner_valid(pattern: SharingPattern, layers: list[LayerSpec]) -> bool:
    try:
        pattern.validate(layers)
    except PatternError:
        return False
    return True


# --- a written-out Qwen3 forward (plain torch, from the module weights) --------------------------------------------

def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """x (B, H, T, D) rotated by position (rotate-half convention)."""
    d, t = x.shape[-1], x.shape[-2]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)  # (D/2,)
    ang = torch.arange(t, dtype=torch.float64)[:, None] * inv[None]  # (T, D/2)
    cos, sin = torch.cat([ang, ang], -1).cos().float(), torch.cat([ang, ang], -1).sin().float()  # (T, D)
    rot = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * cos + rot * sin


def reference_logits(model, ids: torch.Tensor, sources: tuple[int, ...]) -> torch.Tensor:
    """Logits of a Qwen3 model where layer l attends to layer sources[l]'s own K/V (every layer computes its own)."""
    cfg = model.config
    eps, theta = cfg.rms_norm_eps, cfg.rope_parameters["rope_theta"]
    heads, kv_heads, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    b, t = ids.shape
    h = model.model.embed_tokens.weight[ids]  # (B, T, E)
    own: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    for i, layer in enumerate(model.model.layers):
        a = layer.self_attn
        x = _rms(h, layer.input_layernorm.weight, eps)
        q = _rms((x @ a.q_proj.weight.T).view(b, t, heads, d), a.q_norm.weight, eps).transpose(1, 2)  # (B, H, T, D)
        k = _rms((x @ a.k_proj.weight.T).view(b, t, kv_heads, d), a.k_norm.weight, eps).transpose(1, 2)
        v = (x @ a.v_proj.weight.T).view(b, t, kv_heads, d).transpose(1, 2)  # (B, KVH, T, D)
        own[i] = (_rope(k, theta), v)
        k, v = own[sources[i]]
        k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)  # (B, H, T, D)
        scores = (_rope(q, theta) @ k.transpose(-1, -2)) / math.sqrt(d)  # (B, H, T, T)
        attn = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v  # (B, H, T, D)
        h = h + attn.transpose(1, 2).reshape(b, t, heads * d) @ a.o_proj.weight.T
        x = _rms(h, layer.post_attention_layernorm.weight, eps)
        m = layer.mlp
        h = h + (torch.nn.functional.silu(x @ m.gate_proj.weight.T) * (x @ m.up_proj.weight.T)) @ m.down_proj.weight.T
    return _rms(h, model.model.norm.weight, eps) @ model.lm_head.weight.T


@pytest.fixture(scope="module")
def qwen3():
    model = tiny_model("qwen3", seed=3, num_hidden_layers=4)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(9)  # non-trivial norms, so q_norm / k_norm take part in the check
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.3 * torch.randn_like(param))
    return model


def _ids(t=12, seed=0, batch=2):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 120, (batch, t), generator=g)


@torch.inference_mode()
@pytest.mark.parametrize("route", ["0_1_2_3", "0_0_1_2", "0_0_0_0", "0_1_1_0", "0_0_2_1"])
def test_routed_forward_matches_the_written_out_reference(qwen3, route):
    sources = tuple(int(s) for s in route.split("_"))
    ids = _ids()
    with routed(qwen3, lambda: SharingPattern(sources), own_kv=True):
        got = qwen3(ids, use_cache=False).logits
    want = reference_logits(qwen3, ids, sources)
    assert torch.allclose(got, want, atol=TOL), float((got - want).abs().max())
    if route == "0_1_2_3":  # the reference is the model itself when nothing is routed
        assert torch.allclose(qwen3(ids, use_cache=False).logits, want, atol=TOL)
    else:  # and routing changes the result (the check can fail)
        assert not torch.allclose(reference_logits(qwen3, ids, (0, 1, 2, 3)), want, atol=1e-3)


@torch.inference_mode()
def test_stochastic_routing_passes_equal_the_reference_of_their_draw(qwen3):
    ids = _ids(9, seed=4)
    with StochasticKVRouting(qwen3, 0.3, seed=1) as routing:
        outs = [qwen3(ids, use_cache=False).logits for _ in range(8)]
    assert len(routing.draws) == 8 and any(not _owner_valid(d, layer_specs(qwen3.config)) for d in routing.draws)
    for out, draw in zip(outs, routing.draws, strict=True):
        assert torch.allclose(out, reference_logits(qwen3, ids, draw.sources), atol=TOL)


def test_resumed_routing_continues_the_same_draws(qwen3):
    ids = _ids(6, batch=1)
    with torch.inference_mode(), StochasticKVRouting(qwen3, 0.5, seed=3) as unbroken:
        for _ in range(20):
            qwen3(ids, use_cache=False)
    first = StochasticKVRouting(qwen3, 0.5, seed=3)
    with torch.inference_mode(), first:
        for _ in range(10):
            qwen3(ids, use_cache=False)
    saved = json.loads(json.dumps(first.state_dict()))  # it must survive a JSON training state
    assert saved["draws"] == 10 and saved["rule"] == "paper"
    second = StochasticKVRouting(qwen3, 0.5, seed=3)
    second.load_state_dict(saved)
    with torch.inference_mode(), second:
        for _ in range(10):
            qwen3(ids, use_cache=False)
    assert first.draws + second.draws == unbroken.draws and second.drawn == 20
    assert len({d.sources for d in unbroken.draws}) > 3
    replay = StochasticKVRouting(qwen3, 0.5, seed=3)  # without the saved state a new part replays the first draws
    assert [replay._draw() for _ in range(10)] == first.draws != second.draws
    for field, value in (("p", 0.6), ("seed", 4), ("rule", "owner")):
        other = StochasticKVRouting(qwen3, **{"p": 0.5, "seed": 3, "rule": "paper", field: value})
        with pytest.raises(PatternError, match=f"{field}="):
            other.load_state_dict(saved)
    with pytest.raises(PatternError, match=r"not a StochasticKVRouting\.state_dict"):
        StochasticKVRouting(qwen3, 0.5, seed=3).load_state_dict({"p": 0.5, "seed": 3, "rule": "paper"})


def _unrouted(model) -> bool:
    decoder = model.get_decoder()
    return (all("forward" not in layer.self_attn.__dict__ and not hasattr(layer.self_attn, "_kvstate_router")
                for layer in decoder.layers)
            and not hasattr(decoder, "_kvstate_router") and not decoder._forward_pre_hooks and not decoder._forward_hooks
            and type(decoder).forward is decoder.forward.__func__)


def test_plain_pytorch_loop_trains_under_routing():
    model = tiny_model("qwen3", seed=5, num_hidden_layers=4).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = _ids(16, seed=2, batch=4)
    losses = []
    with StochasticKVRouting(model, p=0.5, seed=0) as routing:
        for _ in range(12):
            loss = model(input_ids=ids, labels=ids).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    assert len(routing.draws) == 12 and losses[-1] < losses[0], losses
    assert _unrouted(model)


def test_transformers_trainer_runs_under_routing(tmp_path):
    from transformers import Trainer, TrainingArguments

    model = tiny_model("qwen3", seed=6, num_hidden_layers=4).train()
    rows = _ids(16, seed=8, batch=8)
    data = [{"input_ids": r, "labels": r.clone()} for r in rows]
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2, report_to=[],
                             use_cpu=True, save_strategy="no", logging_strategy="no", disable_tqdm=True)
    before = [p.detach().clone() for p in model.parameters()]
    with StochasticKVRouting(model, p=0.5, seed=0) as routing:
        Trainer(model=model, args=args, train_dataset=data).train()
    assert len(routing.draws) >= 2 and all(isinstance(format_pattern(d), str) for d in routing.draws)
    assert sum(routing.counts().values()) == len(routing.draws)
    assert any(not torch.equal(a, b.detach()) for a, b in zip(before, model.parameters(), strict=True))
    assert _unrouted(model)


def test_bad_input_is_one_clear_error(qwen3):
    for bad in (-0.1, 1.5, True, "0.5", float("nan")):
        with pytest.raises(PatternError, match="p="):
            StochasticKVRouting(qwen3, bad)
        with pytest.raises(PatternError, match="p="):
            draw_route([F, F], bad, random.Random(0))
    with pytest.raises(PatternError, match="--rule 'bogus' is not a registered routing rule; choose one of paper, owner"):
        StochasticKVRouting(qwen3, 0.5, rule="bogus")
    with pytest.raises(PatternError, match="seed"):
        StochasticKVRouting(qwen3, 0.5, seed=-1)
    hybrid = tiny_model("qwen3_5", num_hidden_layers=4)
    with pytest.raises(UnsupportedModelError, match=r"Qwen3_5Attention.*not supported by kvstate\.depth"), \
            StochasticKVRouting(hybrid, 0.5):
        pass
    with pytest.raises(PatternError, match="not an owner"), routed(qwen3, lambda: SharingPattern((0, 0, 1, 2))), \
            torch.inference_mode():
        qwen3(_ids(4, batch=1), use_cache=False)  # an owners-only forward refuses a paper route
    assert _unrouted(qwen3)
