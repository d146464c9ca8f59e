"""Nearest-owner draws: R-CLA restricted to the family where a non-owner reads the closest owner below it.

R-CLA ("Stochastic KV Routing") trains one model to serve many cross-layer sharing patterns; its paper's draw lets a
routed layer read *any* earlier layer's K/V, and the library's ``owner`` rule any earlier owner's. On SmolLM2's 30
layers both reach far down the stack (layer 29 reading layer 3). The families deployments use — CLA2 and the
layer-condensed ``keep`` spread (Brandon et al. 2024; "Layer-Condensed KV Cache"), Gemma 3n's ``top_shared`` —
all read the **nearest** owner below, where adjacent layers' K/V are most alike. A nearest-owner draw picks the
owners (layer 0 always; every other layer with probability ``p``) and lets each non-owner read the closest owner
below it, so the family is "any set of owners" and every keep-0.5 preset is a member. Pure functions; the lab's
fine-tune (:mod:`kvstate.lab.depth.realtrain`) and evaluation (:mod:`kvstate.lab.depth.rcla_eval`) use them.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from typing import Any

from kvstate.errors import KVStateError


def from_owners(layers: Sequence[Any], owners: Iterable[int]) -> Any:
    """The pattern in which every layer not in ``owners`` reads the nearest owner below it (layer 0 must own)."""
    from kvstate.depth.patterns import SharingPattern

    own = set(owners)
    if 0 not in own or not own <= set(range(len(layers))):
        raise KVStateError(f"owners {sorted(own)}: layer 0 must own its K/V and every owner must be a layer "
                           f"0..{len(layers) - 1}")
    sources, last = [], 0
    for i in range(len(layers)):
        last = i if i in own else last
        sources.append(last)
    return SharingPattern(tuple(sources)).validate(layers)


def draw(layers: Sequence[Any], p: float, rng: random.Random) -> Any:
    """One training draw: layer 0 owns, every other layer owns with probability ``p``."""
    return from_owners(layers, [0, *(i for i in range(1, len(layers)) if rng.random() < p)])


def draw_exact(layers: Sequence[Any], owners: int, rng: random.Random) -> Any:
    """A deployment draw with exactly ``owners`` owners: layer 0 and ``owners - 1`` others, uniformly."""
    if not 1 <= owners <= len(layers):
        raise KVStateError(f"owners {owners}: give 1..{len(layers)}")
    return from_owners(layers, [0, *rng.sample(range(1, len(layers)), owners - 1)])


__all__ = ["draw", "draw_exact", "from_owners"]
