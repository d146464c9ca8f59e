"""Routing options that keep retrieval: per-layer p, the annealed schedule, the declared deployment family,
and self-distillation from the own-KV pass."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from kvstate.depth.distill import distillation_loss, own_kv_logits
from kvstate.depth.patterns import (
    LayerSpec,
    PatternError,
    SharingPattern,
    annealed_p,
    check_in_family,
    check_p_layer,
    declared_family,
    draw_pattern,
    draw_route,
)
from kvstate.depth.routing import StochasticKVRouting
from kvstate.models.tiny import tiny_model

F, S = LayerSpec("full_attention", 2, 16), LayerSpec("sliding_attention", 2, 16)


@pytest.mark.parametrize("draw", [draw_route, draw_pattern], ids=["paper", "owner"])
def test_a_layer_at_p1_is_never_routed(draw):
    layers, rng = [F] * 4, random.Random(0)
    draws = [draw(layers, (1, 1, 0.5, 0.5), rng) for _ in range(3000)]
    assert all(d.sources[1] == 1 for d in draws)  # layer 1 at p = 1: always its own K/V
    for layer in (2, 3):  # layers at 0.5 are routed about half the time
        routed = sum(d.sources[layer] != layer for d in draws) / len(draws)
        assert 0.45 < routed < 0.55, (layer, routed)
    # equal per-layer values consume the generator as the scalar does: the same draws
    a, b = random.Random(4), random.Random(4)
    assert [draw(layers, 0.3, a) for _ in range(200)] == [draw(layers, (0.3,) * 4, b) for _ in range(200)]


def test_anneal_schedule_at_start_middle_and_end():
    target = (1.0, 1.0, 0.5, 0.0)
    assert annealed_p(target, 0, 100) == (1.0, 1.0, 1.0, 1.0)
    assert annealed_p(target, 50, 100) == (1.0, 1.0, 0.75, 0.5)
    assert annealed_p(target, 100, 100) == target == annealed_p(target, 10_000, 100)
    assert annealed_p(target, 0, 0) == target  # constant: the target from the first step


def test_routing_follows_the_schedule_and_continues_it():
    model = tiny_model("qwen3", seed=1, num_hidden_layers=4)
    routing = StochasticKVRouting(model, 0.0, seed=0, anneal_steps=10)
    assert routing.current_p() == (1.0,) * 4
    first = routing._draw()
    assert first.sources == (0, 1, 2, 3)  # p = 1 at step 0: nothing is routed
    for _ in range(4):
        routing._draw()
    assert routing.current_p() == (0.5,) * 4  # step 5 of 10, target 0 (layer 0 has no earlier layer to read)
    state = routing.state_dict()
    for _ in range(5):
        routing._draw()
    assert routing.current_p() == (0.0,) * 4
    assert all(d.sources[3] != 3 for d in [routing._draw() for _ in range(20)])  # p = 0: always routed
    again = StochasticKVRouting(model, 0.0, seed=0, anneal_steps=10)
    again.load_state_dict(state)  # a resumed run continues the schedule where it stopped
    assert again.current_p() == (0.5,) * 4
    with pytest.raises(PatternError, match="anneal_steps="):
        StochasticKVRouting(model, 0.0, seed=0, anneal_steps=20).load_state_dict(state)
    with pytest.raises(PatternError, match="p_layer="):
        StochasticKVRouting(model, 0.0, seed=0, anneal_steps=10, p_layer=(1, 0, 0, 0)).load_state_dict(state)
    legacy = {k: v for k, v in StochasticKVRouting(model, 0.5).state_dict().items() if k not in ("p_layer", "anneal_steps")}
    StochasticKVRouting(model, 0.5).load_state_dict(legacy)  # saved before these options existed: still resumes


def _brute_family(layers, ps):
    """Every deployable pattern, filtered by the written-out family rule."""
    out = []
    for sources in itertools.product(*[range(i + 1) for i in range(len(layers))]):
        pat = SharingPattern(tuple(sources))
        try:
            pat.validate(layers)
        except PatternError:
            continue
        firsts = {min(j for j in range(len(layers)) if layers[j].group == spec.group) for spec in layers}
        if all(i in firsts or ((ps[i] < 1 or pat.is_owner(i)) and (ps[i] > 0 or not pat.is_owner(i)))
               for i in range(len(layers))):
            out.append(pat)
    return out


@pytest.mark.parametrize("layers,ps", [([F] * 4, (1, 1, 0.5, 0.5)), ([F] * 4, (1, 0.5, 0.5, 0.5)),
                                       ([F] * 5, (1, 0.5, 1, 0, 0.5)), ([F, S, F, S, F], (1, 1, 0.5, 0.5, 0))])
def test_declared_family_matches_brute_force(layers, ps):
    family = declared_family(layers, ps)
    assert family == sorted(_brute_family(layers, ps), key=lambda p: p.sources)
    for pat in family:
        check_in_family(pat, layers, ps)
    assert declared_family([F] * 4, (1, 1, 0.5, 0.5)) is not None and len(declared_family([F] * 4, (1, 1, 0.5, 0.5))) == 10
    assert declared_family([F] * 6, (0.5,) * 6, limit=10) is None


def test_outside_the_family_is_one_clear_error():
    with pytest.raises(PatternError, match="layer 1 was trained at p = 1"):
        check_in_family(SharingPattern((0, 0, 2, 2)), [F] * 4, (1, 1, 0.5, 0.5))
    with pytest.raises(PatternError, match="layer 3 was trained at p = 0"):
        check_in_family(SharingPattern((0, 1, 2, 3)), [F] * 4, (1, 1, 0.5, 0))


def test_p_layer_bad_input():
    with pytest.raises(PatternError, match="has 3 entries but the model has 4 layers"):
        check_p_layer((1, 1, 0.5), 4)
    with pytest.raises(PatternError, match=r"entry 2 \(layer 2\) is 1.5; each must be a number in \[0, 1\]"):
        check_p_layer((1, 1, 1.5, 0.5), 4)
    with pytest.raises(PatternError, match="entry 0"):
        check_p_layer((True, 1, 1, 1), 4)
    with pytest.raises(PatternError, match="has 3 entries"):
        StochasticKVRouting(tiny_model("qwen3", seed=1, num_hidden_layers=4), 0.5, p_layer=(1, 1, 0.5))


def test_distillation_loss_is_zero_at_the_teacher_and_positive_elsewhere():
    g = torch.Generator().manual_seed(0)
    teacher = torch.randn(2, 5, 11, generator=g)
    assert float(distillation_loss(teacher.clone(), teacher)) == pytest.approx(0.0, abs=1e-6)
    student = (teacher + torch.randn(2, 5, 11, generator=g)).requires_grad_()
    loss = distillation_loss(student, teacher)
    assert float(loss.detach()) > 1e-3
    loss.backward()
    assert student.grad is not None and float(student.grad.abs().sum()) > 0
    weights = torch.zeros(2, 5)
    weights[0, 2] = 1.0  # one position counts: the loss is that position's KL
    one = distillation_loss(student.detach()[:1, 2:3], teacher[:1, 2:3])
    assert float(distillation_loss(student.detach(), teacher, weights)) == pytest.approx(float(one), rel=1e-5)


@torch.no_grad()
def test_teacher_is_the_own_kv_pass_and_consumes_no_draw():
    model = tiny_model("qwen3", seed=2, num_hidden_layers=4)
    ids = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(1))
    plain = model(ids, use_cache=False).logits
    with StochasticKVRouting(model, 0.0, seed=0) as routing:
        student = model(ids, use_cache=False).logits  # p = 0: every layer after the first is routed
        teacher = own_kv_logits(model, routing, ids)
    assert routing.drawn == 1 and len(routing.draws) == 1  # the teacher pass drew nothing
    assert torch.allclose(teacher, plain, atol=1e-5)
    assert float(distillation_loss(student, teacher)) > 1e-4
