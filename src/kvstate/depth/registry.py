"""Registries of the depth axis (pure): R-CLA routing rules and cross-layer sharing-pattern families by name.

A routing rule of Random Cross-Layer Attention ("Stochastic KV Routing") is a :class:`RoutingRule`: how one
training pass draws its route, and whether every layer computes its own K/V in training (the route then reads
those). A sharing-pattern family is a :class:`PatternFamily`: a preset built from one number (CLA's group size,
Gemma 3n's shared top layers, LCKV-style spread owners; "Reducing Transformer Key-Value Cache Size with
Cross-Layer Attention", "Layer-Condensed KV Cache for Efficient Inference of Large Language Models") and, when it
has one, the pattern that keeps a given fraction of the caches. Code picks a rule or a family by looking its name
up here (:meth:`Registry.get`), never by comparing strings; CLIs list their choices from :meth:`Registry.names`,
and an unknown name is refused with one line listing the registry. A new rule or family is one
:meth:`Registry.register` call beside its function. Pure: no torch.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from kvstate.depth.patterns import (
    LayerSpec,
    PatternError,
    SharingPattern,
    cla,
    draw_pattern,
    draw_route,
    keep,
    none,
    top_shared,
)


class Named(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def help(self) -> str: ...


T = TypeVar("T", bound=Named)


class Registry(Generic[T]):
    """Named objects of one kind, in registration order; :meth:`get` refuses an unknown name listing the names."""

    def __init__(self, what: str, option: str) -> None:
        self.what = what  # e.g. "routing rule"
        self.option = option  # the CLI option that takes a name, for the error line
        self._items: dict[str, T] = {}

    def register(self, item: T) -> T:
        if not item.name or item.name in self._items:
            raise PatternError(f"{self.what} {item.name!r} is empty or registered twice; give it a new name")
        self._items[item.name] = item
        return item

    def names(self) -> tuple[str, ...]:
        return tuple(self._items)

    def get(self, name: object) -> T:
        if not isinstance(name, str) or name not in self._items:
            raise PatternError(f"{self.option} {name!r} is not a registered {self.what}; choose one of "
                               f"{', '.join(self.names())}")
        return self._items[name]

    def describe(self) -> str:
        """``name: help; ...`` for CLI help texts."""
        return "; ".join(f"{i.name}: {i.help}" for i in self._items.values())

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._items


Draw = Callable[[Sequence[LayerSpec], float | Sequence[float], random.Random], SharingPattern]


@dataclass(frozen=True)
class RoutingRule:
    """How an R-CLA training pass draws its route."""

    name: str
    draw: Draw  # (layers, p or per-layer p, rng) -> route
    own_kv: bool  # every layer computes its own K/V in training and a route reads those (else: earlier owners only)
    help: str


@dataclass(frozen=True)
class PatternFamily:
    """A preset family of sharing patterns: ``build(layers, value)`` and, if it has one, ``at_keep(layers, fraction)``."""

    name: str
    build: Callable[[Sequence[LayerSpec], float], SharingPattern]
    at_keep: Callable[[Sequence[LayerSpec], float], SharingPattern] | None
    help: str


RULES: Registry[RoutingRule] = Registry("routing rule", "--rule")
RULES.register(RoutingRule("paper", draw_route, True, "a routed layer reads any earlier layer's own K/V (the paper's)"))
RULES.register(RoutingRule("owner", draw_pattern, False, "a routed layer reads an earlier owner (ablation)"))


def _cla_at_keep(layers: Sequence[LayerSpec], fraction: float) -> SharingPattern:
    k = round(1 / fraction) if fraction > 0 else 0
    if k < 1 or not math.isclose(k * fraction, 1.0, abs_tol=1e-6):
        raise PatternError(f"cla: keep fraction {fraction!r} is not 1/k for a whole k; choose 1, 0.5, 0.25, ...")
    return cla(layers, k)


def _top_shared_at_keep(layers: Sequence[LayerSpec], fraction: float) -> SharingPattern:
    total = sum(spec.is_attention for spec in layers)
    n = (1 - fraction) * total
    if not math.isclose(n, round(n), abs_tol=1e-6) or not 0 <= round(n) < total:
        raise PatternError(f"top_shared: keep fraction {fraction!r} of {total} attention layers is not a whole "
                           "number of kept caches")
    return top_shared(layers, round(n))


FAMILIES: Registry[PatternFamily] = Registry("pattern family", "--pattern-kind")
FAMILIES.register(PatternFamily("keep", lambda layers, v: keep(layers, float(v)), keep,
                                "keep a fraction of the caches, owners spread evenly"))
FAMILIES.register(PatternFamily("cla", lambda layers, v: cla(layers, int(v)), _cla_at_keep,
                                "runs of k adjacent layers read the first's K/V (CLA)"))
FAMILIES.register(PatternFamily("top_shared", lambda layers, v: top_shared(layers, int(v)), _top_shared_at_keep,
                                "the top n layers read the last owner below them (Gemma 3n)"))
FAMILIES.register(PatternFamily("none", lambda layers, v: none(layers), None, "no sharing"))


def keep_families() -> tuple[str, ...]:
    """The families that have a pattern per kept fraction (``--pattern-kind`` choices)."""
    return tuple(n for n in FAMILIES.names() if FAMILIES.get(n).at_keep is not None)


__all__ = ["FAMILIES", "RULES", "PatternFamily", "Registry", "RoutingRule", "keep_families"]
