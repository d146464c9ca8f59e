"""Cross-layer sharing patterns (pure): validation against brute-force enumeration, presets, draws."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from kvstate.depth.patterns import (
    LayerSpec,
    PatternError,
    SharingPattern,
    cla,
    draw_pattern,
    draw_route,
    for_keep,
    format_pattern,
    keep,
    kept_fraction,
    kv_bytes,
    none,
    parse_pattern,
    top_shared,
)

F, S, R = LayerSpec("full_attention", 2, 16), LayerSpec("sliding_attention", 2, 16), LayerSpec("recurrent")
F1 = LayerSpec("full_attention", 1, 16)  # another KV shape
LAYOUTS = {
    "uniform4": [F, F, F, F],
    "uniform5": [F, F, F, F, F],
    "mixed": [F, S, F, S, S],
    "hybrid": [R, R, F, R, F],
    "shapes": [F, F1, F, F1],
}


def constructive(layers: list[LayerSpec]) -> set[tuple[int, ...]]:
    """Every valid pattern, built from the rules: pick owners, then point each other attention layer at
    an earlier owner with the same kind and KV shape; recurrent layers read themselves."""
    attn = [i for i, s in enumerate(layers) if s.kind != "recurrent"]
    out = set()
    for r in range(len(attn) + 1):
        for owners in itertools.combinations(attn, r):
            choices = []
            for i in range(len(layers)):
                if layers[i].kind == "recurrent" or i in owners:
                    choices.append([i])
                else:
                    choices.append([o for o in owners if o < i and layers[o] == layers[i]])
            out.update(itertools.product(*choices))
    return out


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_validate_matches_brute_force(name):
    layers = LAYOUTS[name]
    n = len(layers)
    expected = constructive(layers)
    accepted = set()
    for sources in itertools.product(range(n), repeat=n):
        try:
            SharingPattern(sources).validate(layers)
        except PatternError:
            continue
        accepted.add(sources)
    assert accepted == expected and tuple(range(n)) in accepted


@pytest.mark.parametrize("sources, layers, words", [
    ((0, 2, 2, 3), LAYOUTS["uniform4"], ("layer 1", "after")),
    ((0, 0, 1, 3), LAYOUTS["uniform4"], ("layer 2", "not an owner")),
    ((0, 0, 2, 3, 4), LAYOUTS["mixed"], ("layer 1", "attention type")),
    ((0, 1, 2, 3, 3), LAYOUTS["hybrid"], ("layer 4", "recurrent")),
    ((0, 0, 2, 3, 4), LAYOUTS["hybrid"], ("layer 1", "recurrent")),
    ((0, 0, 2, 3), LAYOUTS["shapes"], ("layer 1", "KV shape")),
    ((0, 0, 2), LAYOUTS["uniform4"], ("3 layers", "4")),
])
def test_errors_name_layer_and_rule(sources, layers, words):
    with pytest.raises(PatternError) as info:
        SharingPattern(sources).validate(layers)
    assert all(w in str(info.value) for w in words), str(info.value)


def test_presets_on_four_layers():
    L = LAYOUTS["uniform4"]
    assert none(L).sources == (0, 1, 2, 3)
    assert cla(L, 2).sources == (0, 0, 2, 2)
    assert cla(L, 4).sources == (0, 0, 0, 0)
    assert top_shared(L, 2).sources == (0, 1, 1, 1)
    assert [keep(L, f).sources for f in (1, 0.75, 0.5, 0.25)] == [(0, 1, 2, 3), (0, 1, 2, 2), (0, 0, 2, 2), (0, 0, 0, 0)]
    assert for_keep(L, "cla", 0.5) == cla(L, 2) and for_keep(L, "top_shared", 0.75) == top_shared(L, 1)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_every_preset_is_valid_and_keeps_what_it_says(name):
    layers = LAYOUTS[name]
    n_attn = sum(s.kind != "recurrent" for s in layers)
    groups = len({s.group for s in layers if s.kind != "recurrent"})
    for m in range(groups, n_attn + 1):
        p = keep(layers, m / n_attn)
        assert p.validate(layers) is p and math.isclose(kept_fraction(p, layers), m / n_attn)
    for k in (1, 2, 3):
        cla(layers, k).validate(layers)
    attn = [i for i, s in enumerate(layers) if s.kind != "recurrent"]
    for m in range(groups, n_attn + 1):
        shared = set(attn[m:])  # the top n_attn - m attention layers
        whole_group_shared = any(all(i in shared for i in attn if layers[i].group == g)
                                 for g in {layers[i].group for i in attn})
        try:
            top_shared(layers, n_attn - m).validate(layers)
            refused = False
        except PatternError as exc:  # only when a group's layers would all be shared
            assert "no earlier owner" in str(exc)
            refused = True
        assert refused == whole_group_shared, (m, shared)


def test_unrealisable_keep_fractions():
    with pytest.raises(PatternError, match="not a whole number"):
        keep(LAYOUTS["uniform4"], 0.3)
    with pytest.raises(PatternError, match="groups"):
        keep(LAYOUTS["mixed"], 0.2)  # 1 cache for 2 attention types
    with pytest.raises(PatternError, match="1/k"):
        for_keep(LAYOUTS["uniform4"], "cla", 0.75)
    with pytest.raises(PatternError, match="not realisable"):
        for_keep(LAYOUTS["uniform5"], "cla", 0.5)  # CLA2 on 5 layers keeps 3 of 5


def test_format_parse_round_trip_and_bad_strings():
    for sources in constructive(LAYOUTS["mixed"]):
        p = SharingPattern(sources)
        assert parse_pattern(format_pattern(p)) == p
    assert format_pattern(cla(LAYOUTS["uniform4"], 2)) == "0_0_2_2"
    for bad in ("0-0-2-2", "0__2", "a_b", "", "0_-1", "0_²", "0_١", "0_+1"):  # ASCII digits only
        with pytest.raises(PatternError):
            parse_pattern(bad)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_kv_bytes_drop_exactly_with_non_owners(name):
    layers = LAYOUTS[name]
    full = kv_bytes(none(layers), layers, 2)
    assert full == sum(2 * s.kv_heads * s.head_dim * 2 for s in layers)
    for sources in constructive(layers):
        p = SharingPattern(sources)
        dropped = sum(2 * layers[i].kv_heads * layers[i].head_dim * 2 for i, s in enumerate(sources) if s != i)
        assert kv_bytes(p, layers, 2) == full - dropped


def test_draws_match_p_within_a_binomial_bound():
    layers, p, n = LAYOUTS["uniform4"], 0.7, 4000
    rng = random.Random(123)
    draws = [draw_pattern(layers, p, rng) for _ in range(n)]
    for d in draws:
        d.validate(layers)
    own = [sum(d.is_owner(i) for d in draws) / n for i in range(4)]
    sigma = math.sqrt(p * (1 - p) / n)
    assert own[0] == 1.0 and all(abs(own[i] - p) < 4 * sigma for i in (1, 2, 3)), own
    # layer 2 shared, layer 1 an owner: the earlier owners 0 and 1 are chosen uniformly
    picks = [d.sources[2] for d in draws if d.is_owner(1) and not d.is_owner(2)]
    half = sum(s == 0 for s in picks) / len(picks)
    assert abs(half - 0.5) < 4 * math.sqrt(0.25 / len(picks)), half
    again = random.Random(123)
    assert [draw_pattern(layers, p, again) for _ in range(50)] == draws[:50]  # reproducible from the seed


@pytest.mark.parametrize("draw", [draw_pattern, draw_route])
def test_draw_extremes_and_bad_p(draw):
    layers = LAYOUTS["hybrid"]
    rng = random.Random(0)
    assert draw(layers, 1.0, rng) == none(layers)
    assert draw(layers, 0.0, rng).sources == (0, 1, 2, 3, 2)  # recurrent layers untouched
    for bad in (-0.1, 1.5, True, None):
        with pytest.raises(PatternError, match="p="):
            draw(layers, bad, rng)
