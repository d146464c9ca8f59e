"""Random Cross-Layer Attention (R-CLA), the training side of "Stochastic KV Routing".

:class:`StochasticKVRouting` is a context manager over an HF model: at every forward pass each
attention layer keeps its own K/V with probability ``p``, otherwise it attends to the K/V of a
uniformly chosen earlier owner of its type and shape (:func:`kvstate.depth.patterns.draw_pattern`).
Trained this way, one model serves any sharing pattern at deployment. Draws come from a
``random.Random`` seeded by ``seed`` (reproducible, independent of torch's global RNG) and are
logged in :attr:`StochasticKVRouting.draws`. The routed forward behaves the same with and without a
cache object, and the hooks are removed on exit, also on exceptions.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass
from typing import Any

from kvstate.depth.attention import layer_specs, routed
from kvstate.depth.patterns import PatternError, SharingPattern, draw_pattern, format_pattern


@dataclass(frozen=True)
class RoutingConfig:
    p: float  # probability that a layer attends to its own K/V (1: no routing)
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.p, (int, float)) or not 0.0 <= self.p <= 1.0:
            raise PatternError(f"routing p={self.p!r} must lie in [0, 1] (1: every layer keeps its own K/V)")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise PatternError(f"routing seed={self.seed!r} must be an int >= 0")


class StochasticKVRouting:
    """``with StochasticKVRouting(model, p, seed): model(...)`` — a fresh route per forward pass."""

    def __init__(self, model: Any, p: float, seed: int = 0) -> None:
        self.config = RoutingConfig(float(p), seed)
        self.model = model
        self.layers = layer_specs(model.config)
        self.rng = random.Random(seed)
        self.draws: list[SharingPattern] = []  # one per forward pass, in order
        self._ctx: Any = None

    def _draw(self) -> SharingPattern:
        pattern = draw_pattern(self.layers, self.config.p, self.rng)
        self.draws.append(pattern)
        return pattern

    def counts(self) -> Counter[str]:
        """How often each pattern was drawn (compact string form)."""
        return Counter(format_pattern(d) for d in self.draws)

    def __enter__(self) -> StochasticKVRouting:
        self._ctx = routed(self.model, self._draw)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        ctx, self._ctx = self._ctx, None
        ctx.__exit__(*exc)


__all__ = ["RoutingConfig", "StochasticKVRouting"]
