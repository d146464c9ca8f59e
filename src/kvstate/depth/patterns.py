"""Cross-layer KV sharing patterns (pure): which layer's keys/values each decoder layer attends to.

A :class:`SharingPattern` maps every decoder layer to the layer whose K/V it reads; a layer that reads
itself is an *owner* and the only kind that holds a cache. Presets follow "Reducing Transformer
Key-Value Cache Size with Cross-Layer Attention" (CLA: groups of adjacent layers read the first's
KV), Gemma 3n's KV sharing (the top layers read the last owner), and "Layer-Condensed KV Cache for
Efficient Inference of Large Language Models" (the compact string ``"0_0_2_2"``). Random
Cross-Layer Attention (R-CLA, "Stochastic KV Routing") trains one model so that any valid pattern
works at deployment; :func:`keep` picks the pattern that keeps a given fraction of the caches.

Rules (checked by :meth:`SharingPattern.validate`, each error names the layer and the rule): a layer
reads a layer at or before it, that layer is an owner, of the same attention type (full vs sliding
window) and the same KV shape; recurrent layers take no part (they read only themselves and nobody
reads them). A *route* (one training pass of R-CLA as the paper describes it, :func:`draw_route`) has
the same form but every layer computes its own K/V, so a layer may read any earlier layer of its group
(``validate(layers, require_owners=False)``): ``"0_0_1_2"`` is a route, not a deployable pattern.
Pure: ints and tuples only. Ignored: sharing across batch rows, partial (per-head) sharing.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass

from kvstate.errors import KVStateError

RECURRENT = "recurrent"  # LayerSpec.kind of a layer with a recurrent state (never shared)
ATTENTION_KINDS = ("full_attention", "sliding_attention")


class PatternError(KVStateError):
    """A sharing pattern that breaks a rule, or a preset that no pattern can realise."""


@dataclass(frozen=True)
class LayerSpec:
    """What a decoder layer's KV looks like, for the sharing rules."""

    kind: str  # "full_attention", "sliding_attention" or "recurrent"
    kv_heads: int = 0  # key/value heads (0 for recurrent layers)
    head_dim: int = 0  # per-head dimension (0 for recurrent layers)

    def __post_init__(self) -> None:
        if self.kind not in (*ATTENTION_KINDS, RECURRENT):
            raise PatternError(f"LayerSpec.kind={self.kind!r} must be one of {', '.join((*ATTENTION_KINDS, RECURRENT))}")
        if self.kind != RECURRENT and (self.kv_heads < 1 or self.head_dim < 1):
            raise PatternError(f"LayerSpec: an attention layer needs kv_heads >= 1 and head_dim >= 1, got "
                               f"{self.kv_heads} and {self.head_dim}")

    @property
    def is_attention(self) -> bool:
        return self.kind != RECURRENT

    @property
    def group(self) -> tuple[str, int, int]:
        """Layers may share only within one group: same attention type and KV shape."""
        return (self.kind, self.kv_heads, self.head_dim)


@dataclass(frozen=True)
class SharingPattern:
    """``sources[l]`` = the layer whose K/V layer ``l`` attends to (``l`` itself: an owner)."""

    sources: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.sources:
            raise PatternError("SharingPattern.sources is empty; give one source per decoder layer")
        for layer, src in enumerate(self.sources):
            if not isinstance(src, int) or isinstance(src, bool) or src < 0:
                raise PatternError(f"layer {layer}: source {src!r} must be a layer index >= 0")

    def __len__(self) -> int:
        return len(self.sources)

    @property
    def owners(self) -> tuple[int, ...]:
        """Layers that read their own K/V (recurrent layers included)."""
        return tuple(i for i, s in enumerate(self.sources) if s == i)

    def is_owner(self, layer: int) -> bool:
        return self.sources[layer] == layer

    def validate(self, layers: Sequence[LayerSpec], *, require_owners: bool = True) -> SharingPattern:
        """Raise :class:`PatternError` naming the first layer that breaks a rule; return ``self``.

        ``require_owners=False`` checks a training route instead (:func:`draw_route`): the source may itself
        read another layer, since in training every layer computes its own K/V and the route reads those.
        """
        if len(self.sources) != len(layers):
            raise PatternError(f"pattern {format_pattern(self)!r} has {len(self.sources)} layers but the model has "
                               f"{len(layers)}; give one source per decoder layer")
        for layer, src in enumerate(self.sources):
            spec = layers[layer]
            if not spec.is_attention:
                if src != layer:
                    raise PatternError(f"layer {layer} is recurrent and reads layer {src}: recurrent layers are "
                                       "never shared; give it its own index")
                continue
            if src > layer:
                raise PatternError(f"layer {layer} reads layer {src}, which comes after it: a layer may only read "
                                   "itself or an earlier layer")
            if src == layer:
                continue
            target = layers[src]
            if not target.is_attention:
                raise PatternError(f"layer {layer} reads layer {src}, which is recurrent: only attention layers "
                                   "share K/V")
            if require_owners and self.sources[src] != src:
                raise PatternError(f"layer {layer} reads layer {src}, which is not an owner (it reads layer "
                                   f"{self.sources[src]}): point it at an owner")
            if target.kind != spec.kind:
                raise PatternError(f"layer {layer} ({spec.kind}) reads layer {src} ({target.kind}): sharing must "
                                   "stay within one attention type")
            if (target.kv_heads, target.head_dim) != (spec.kv_heads, spec.head_dim):
                raise PatternError(f"layer {layer} (KV {spec.kv_heads}x{spec.head_dim}) reads layer {src} (KV "
                                   f"{target.kv_heads}x{target.head_dim}): sharing needs the same KV shape")
        return self


def format_pattern(pattern: SharingPattern) -> str:
    """The compact string of Layer-Condensed KV Cache: sources joined by ``_`` (``"0_0_2_2"``)."""
    return "_".join(str(s) for s in pattern.sources)


def parse_pattern(text: str) -> SharingPattern:
    """Inverse of :func:`format_pattern`; raises :class:`PatternError` on anything else."""
    parts = text.strip().split("_")
    if not all(re.fullmatch(r"[0-9]+", p) for p in parts):  # ASCII digits: isdigit() takes "²", int() does not
        raise PatternError(f"pattern {text!r} is not of the form '0_0_2_2' (one source layer index per layer, "
                           "joined by '_')")
    return SharingPattern(tuple(int(p) for p in parts))


def _attention_groups(layers: Sequence[LayerSpec]) -> list[list[int]]:
    """Attention layer indices grouped by (type, KV shape), each group in layer order."""
    groups: dict[tuple[str, int, int], list[int]] = {}
    for i, spec in enumerate(layers):
        if spec.is_attention:
            groups.setdefault(spec.group, []).append(i)
    return list(groups.values())


def _from_owners(layers: Sequence[LayerSpec], owners: set[int]) -> SharingPattern:
    """Every non-owner attention layer reads the nearest earlier owner of its group."""
    sources = list(range(len(layers)))
    for group in _attention_groups(layers):
        last = None
        for i in group:
            if i in owners:
                last = i
            elif last is None:
                raise PatternError(f"layer {i} has no earlier owner of its type and KV shape: the first layer of "
                                   "each group must keep its cache")
            else:
                sources[i] = last
    return SharingPattern(tuple(sources)).validate(layers)


def none(layers: Sequence[LayerSpec]) -> SharingPattern:
    """No sharing: every layer keeps its own cache."""
    return SharingPattern(tuple(range(len(layers))))


def cla(layers: Sequence[LayerSpec], k: int) -> SharingPattern:
    """Cross-Layer Attention: within each group, runs of ``k`` adjacent layers read the first's K/V."""
    if not isinstance(k, int) or k < 1:
        raise PatternError(f"cla: k={k!r} must be an int >= 1 (k = 2 is CLA2)")
    owners = {i for group in _attention_groups(layers) for j, i in enumerate(group) if j % k == 0}
    return _from_owners(layers, owners)


def top_shared(layers: Sequence[LayerSpec], n: int) -> SharingPattern:
    """Gemma 3n style: the last ``n`` attention layers read the last owner of their group below them."""
    attn = [i for i, spec in enumerate(layers) if spec.is_attention]
    if not isinstance(n, int) or not 0 <= n < len(attn):
        raise PatternError(f"top_shared: n={n!r} must be an int in [0, {len(attn) - 1}] (the model has "
                           f"{len(attn)} attention layers and at least one keeps its cache)")
    shared = set(attn[len(attn) - n:])
    return _from_owners(layers, {i for i in attn if i not in shared})


def _spread(count: int, owners: int) -> list[int]:
    """``owners`` positions out of ``count`` spread evenly, the first always included."""
    return sorted({(j * count) // owners for j in range(owners)})


def keep(layers: Sequence[LayerSpec], fraction: float) -> SharingPattern:
    """Keep ``fraction`` of the attention caches, owners spread evenly within each group.

    The kept count ``fraction * attention layers`` must be a whole number and at least the number of
    groups (each group's first layer has no earlier layer to read); owners are split over groups by
    largest remainder, at least one each.
    """
    groups = _attention_groups(layers)
    total = sum(len(g) for g in groups)
    if total == 0:
        raise PatternError("keep: the model has no attention layers to share")
    kept = fraction * total
    if not 0 < fraction <= 1 or not math.isclose(kept, round(kept), abs_tol=1e-6):
        allowed = ", ".join(f"{m / total:g}" for m in range(len(groups), total + 1))
        raise PatternError(f"keep: fraction {fraction!r} of {total} attention layers is not a whole number of "
                           f"caches; choose one of {allowed}")
    kept = round(kept)
    if kept < len(groups):
        raise PatternError(f"keep: fraction {fraction!r} keeps {kept} caches but the model has {len(groups)} groups "
                           "of attention type and KV shape, each needing one; choose a fraction >= "
                           f"{len(groups) / total:g}")
    quotas = [1 + (kept - len(groups)) * (len(g) - 1) / max(1, total - len(groups)) for g in groups]
    counts = [math.floor(q) for q in quotas]
    order = sorted(range(len(groups)), key=lambda j: counts[j] - quotas[j])
    for j in order[: kept - sum(counts)]:
        counts[j] += 1
    owners = {g[p] for g, c in zip(groups, counts, strict=True) for p in _spread(len(g), min(c, len(g)))}
    return _from_owners(layers, owners)


def kept_fraction(pattern: SharingPattern, layers: Sequence[LayerSpec]) -> float:
    """Owners among the attention layers (1.0: no sharing)."""
    attn = [i for i, spec in enumerate(layers) if spec.is_attention]
    return sum(pattern.is_owner(i) for i in attn) / len(attn) if attn else 1.0


def kv_bytes(pattern: SharingPattern, layers: Sequence[LayerSpec], dtype_bytes: int) -> int:
    """Attention K/V bytes per token under ``pattern``: only owners hold a cache."""
    from kvstate.models.accounting import kv_token_bytes

    pattern.validate(layers)
    return sum(kv_token_bytes(layers[i].kv_heads, layers[i].head_dim, dtype_bytes)
               for i in pattern.owners if layers[i].is_attention)


def check_p(p: object) -> float:
    """The routing probability as a float; :class:`PatternError` unless a number in [0, 1] (not a bool)."""
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
        raise PatternError(f"routing probability p={p!r} must be a number in [0, 1] (1: every layer keeps its own "
                           "K/V)")
    return float(p)


def check_p_layer(p_layer: object, n_layers: int, option: str = "--p-layer") -> tuple[float, ...]:
    """Per-layer routing probabilities as a tuple; :class:`PatternError` naming the input unless one number in
    [0, 1] per decoder layer."""
    if isinstance(p_layer, (str, bytes)) or not isinstance(p_layer, Sequence):
        raise PatternError(f"{option} {p_layer!r} must be a list of probabilities, one per layer (e.g. 1,1,0.5,0.5)")
    if len(p_layer) != n_layers:
        raise PatternError(f"{option} has {len(p_layer)} entries but the model has {n_layers} layers; give one "
                           f"probability per layer (e.g. {','.join(['1'] + ['0.5'] * (n_layers - 1))})")
    for i, v in enumerate(p_layer):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
            raise PatternError(f"{option} entry {i} (layer {i}) is {v!r}; each must be a number in [0, 1] (1: the "
                               "layer always keeps its own K/V)")
    return tuple(float(v) for v in p_layer)


def _per_layer(p: float | Sequence[float], n: int) -> tuple[float, ...]:
    return check_p_layer(p, n, "p") if isinstance(p, Sequence) and not isinstance(p, str) else (check_p(p),) * n


def annealed_p(target: Sequence[float], step: int, anneal_steps: int) -> tuple[float, ...]:
    """LayerSkip-style schedule of the per-layer p: 1 at step 0, linear to ``target`` at ``anneal_steps``, then
    constant (``anneal_steps = 0``: the target throughout). Early steps train the model it started as; sharing
    then grows, so the routes the model cannot yet use do not wipe out what it can do."""
    if anneal_steps <= 0 or step >= anneal_steps:
        return tuple(float(t) for t in target)
    frac = max(step, 0) / anneal_steps
    return tuple(1.0 - (1.0 - float(t)) * frac for t in target)


def draw_route(layers: Sequence[LayerSpec], p: float | Sequence[float], rng: random.Random) -> SharingPattern:
    """One Random Cross-Layer Attention draw as the paper describes it: each attention layer, in order, keeps
    its own K/V with probability ``p``, else reads the *own* K/V of a uniformly chosen earlier layer of its
    group (same attention type and KV shape; every layer computes its own K/V in training). The first
    layer of a group has no earlier layer and reads its own; recurrent layers read themselves. The result
    is a route (``validate(layers, require_owners=False)``), e.g. ``0_0_1_2``; at p = 0.5 on 4 layers
    ``0_0_0_0`` has probability 1/2 * 1/4 * 1/6 = 1/48. ``p`` may be one probability per layer (a layer at
    1 is never routed); the generator is consumed the same way, so equal per-layer values give the scalar's
    draws."""
    ps = _per_layer(p, len(layers))
    sources = list(range(len(layers)))
    for group in _attention_groups(layers):
        for j, i in enumerate(group):
            if j and rng.random() >= ps[i]:
                sources[i] = group[rng.randrange(j)]
    return SharingPattern(tuple(sources))


def draw_pattern(layers: Sequence[LayerSpec], p: float | Sequence[float], rng: random.Random) -> SharingPattern:
    """The ``owner`` variant of an R-CLA draw (kept for ablation; :func:`draw_route` is the paper's): each
    attention layer, in order, keeps its own K/V with probability ``p``, else reads a uniformly chosen
    earlier *owner* of its group, so every draw is a deployable pattern. It is not the paper's
    distribution: earlier sharing shrinks the choice, so at p = 0.5 on 4 layers ``0_0_0_0`` has
    probability 1/8 instead of 1/48. ``p`` may be one probability per layer, as in :func:`draw_route`."""
    ps = _per_layer(p, len(layers))
    sources = list(range(len(layers)))
    for group in _attention_groups(layers):
        owners: list[int] = []
        for i in group:
            if owners and rng.random() >= ps[i]:
                sources[i] = owners[rng.randrange(len(owners))]
            else:
                owners.append(i)
    return SharingPattern(tuple(sources))


def check_in_family(pattern: SharingPattern, layers: Sequence[LayerSpec], p_layer: Sequence[float]) -> SharingPattern:
    """Raise :class:`PatternError` unless ``pattern`` is deployable and in the family a training run with per-layer
    probabilities ``p_layer`` declares: a layer trained at p = 1 owns its K/V (it never learned to read another's),
    a layer trained at p = 0 (not the first of its group) never does; the others may do either."""
    pattern.validate(layers)
    ps = check_p_layer(p_layer, len(layers), "p_layer")
    firsts = {g[0] for g in _attention_groups(layers)}
    for i, spec in enumerate(layers):
        if not spec.is_attention or i in firsts:
            continue
        if ps[i] == 1.0 and not pattern.is_owner(i):
            raise PatternError(f"pattern {format_pattern(pattern)!r}: layer {i} was trained at p = 1 (always its own "
                               f"K/V) but reads layer {pattern.sources[i]}; deploy a pattern where layer {i} is an owner")
        if ps[i] == 0.0 and pattern.is_owner(i):
            raise PatternError(f"pattern {format_pattern(pattern)!r}: layer {i} was trained at p = 0 (always routed) but "
                               "keeps its own K/V; deploy a pattern where it reads an earlier owner")
    return pattern


def declared_family(layers: Sequence[LayerSpec], p_layer: Sequence[float], limit: int = 4096) -> list[SharingPattern] | None:
    """Every deployable pattern of the family ``p_layer`` declares (:func:`check_in_family`), in lexicographic
    order of sources; ``None`` when there are more than ``limit`` (enumeration grows like a factorial)."""
    ps = check_p_layer(p_layer, len(layers), "p_layer")
    groups = _attention_groups(layers)
    firsts = {g[0] for g in groups}
    group_of = {i: g for g in groups for i in g}
    found: list[SharingPattern] = []

    def walk(i: int, sources: list[int]) -> bool:
        if i == len(layers):
            found.append(SharingPattern(tuple(sources)))
            return len(found) <= limit
        if not layers[i].is_attention or i in firsts:
            return walk(i + 1, [*sources, i])
        options = [] if ps[i] == 1.0 else [j for j in group_of[i] if j < i and sources[j] == j]
        if ps[i] != 0.0:
            options.append(i)
        return all(walk(i + 1, [*sources, s]) for s in sorted(options))

    return found if walk(0, []) else None


def preset(layers: Sequence[LayerSpec], kind: str, value: float = 0) -> SharingPattern:
    """A preset by family name (:data:`kvstate.depth.registry.FAMILIES`: ``keep`` (fraction), ``cla`` (k),
    ``top_shared`` (n), ``none``); an unknown name is refused listing the registry."""
    from kvstate.depth.registry import FAMILIES

    return FAMILIES.get(kind).build(layers, value)


def for_keep(layers: Sequence[LayerSpec], kind: str, fraction: float) -> SharingPattern:
    """The pattern of family ``kind`` (a registered family with a pattern per kept fraction: ``keep``, ``cla``,
    ``top_shared``) that keeps ``fraction`` of the caches."""
    from kvstate.depth.registry import FAMILIES, keep_families

    family = FAMILIES.get(kind)
    if family.at_keep is None:
        raise PatternError(f"--pattern-kind {kind!r} has no pattern per kept fraction; choose one of "
                           f"{', '.join(keep_families())}")
    pattern = family.at_keep(layers, fraction)
    if not math.isclose(kept_fraction(pattern, layers), fraction, abs_tol=1e-6):
        total = sum(spec.is_attention for spec in layers)
        raise PatternError(f"{kind}: keep fraction {fraction!r} is not realisable on {total} attention layers "
                           f"(the nearest {kind} pattern keeps {kept_fraction(pattern, layers):g})")
    return pattern


__all__ = ["ATTENTION_KINDS", "RECURRENT", "LayerSpec", "PatternError", "SharingPattern", "annealed_p",
           "check_in_family", "check_p", "check_p_layer", "cla", "declared_family", "draw_pattern", "draw_route", "for_keep", "format_pattern", "keep", "kept_fraction", "kv_bytes", "none",
           "parse_pattern", "preset", "top_shared"]
