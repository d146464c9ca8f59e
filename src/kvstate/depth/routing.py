"""Random Cross-Layer Attention (R-CLA), the training side of "Stochastic KV Routing".

:class:`StochasticKVRouting` is a context manager over an HF model that draws a fresh route at every
forward pass. Two rules (``rule=``):

- ``"paper"`` (default), as the paper describes it: every attention layer computes its own K/V; each
  layer attends to its own K/V with probability ``p``, otherwise to the *own* K/V of a uniformly chosen
  earlier layer of its type and shape (:func:`kvstate.depth.patterns.draw_route`; the route ``0_0_1_2``
  has layer 2 read layer 1's own K/V although layer 1 itself reads layer 0's);
- ``"owner"``, a variant kept for ablation: a layer falls back to a uniformly chosen earlier *owner*
  (:func:`kvstate.depth.patterns.draw_pattern`), so every draw is a deployable pattern and non-owners
  skip their K/V projections. It is a different distribution: earlier sharing narrows the choice, so
  all-to-layer-0 is 1/8 likely at p = 0.5 on 4 layers instead of the paper's 1/48.

``p_layer`` gives each layer its own probability (a layer at 1 is never routed: the deployment family then
keeps it an owner, :func:`kvstate.depth.patterns.declared_family`), and ``anneal_steps`` anneals p from 1 to
the target over the first draws (LayerSkip's p(l, t), :func:`kvstate.depth.patterns.annealed_p`).
:meth:`StochasticKVRouting.own_kv_pass` runs forward passes with every layer on its own K/V without
consuming a draw (the teacher of self-distillation, :mod:`kvstate.depth.distill`).

Trained this way, one model serves any sharing pattern at deployment. Draws come from a
``random.Random`` seeded by ``seed`` (reproducible, independent of torch's global RNG) and are
logged in :attr:`StochasticKVRouting.draws`; :meth:`~StochasticKVRouting.state_dict` /
:meth:`~StochasticKVRouting.load_state_dict` (JSON-serialisable) let a resumed run continue the same
draws. The routed forward behaves the same with and without a cache object, and the hooks are
removed on exit, also on exceptions, so it works inside any loop (plain PyTorch, ``transformers.Trainer``).
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from kvstate.depth.attention import layer_specs, routed
from kvstate.depth.patterns import (
    PatternError,
    SharingPattern,
    annealed_p,
    check_p,
    check_p_layer,
    format_pattern,
    none,
)
from kvstate.depth.registry import RULES, RoutingRule


@dataclass(frozen=True)
class RoutingConfig:
    p: float  # probability that a layer attends to its own K/V (1: no routing)
    seed: int = 0
    rule: str = "paper"  # a name in kvstate.depth.registry.RULES ("paper": draw_route, "owner": draw_pattern)
    p_layer: tuple[float, ...] | None = None  # per-layer p (replaces p); checked against the model's layers
    anneal_steps: int = 0  # p goes from 1 to the target over this many draws (0: the target from the start)

    def __post_init__(self) -> None:
        check_p(self.p)
        if self.p_layer is not None:
            check_p_layer(self.p_layer, len(self.p_layer), "p_layer")
        if isinstance(self.anneal_steps, bool) or not isinstance(self.anneal_steps, int) or self.anneal_steps < 0:
            raise PatternError(f"routing anneal_steps={self.anneal_steps!r} must be an int >= 0 (0: no annealing)")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise PatternError(f"routing seed={self.seed!r} must be an int >= 0")
        RULES.get(self.rule)  # refuses an unknown rule, listing the registry


class StochasticKVRouting:
    """``with StochasticKVRouting(model, p, seed, rule): model(...)`` — a fresh route per forward pass."""

    def __init__(self, model: Any, p: float, seed: int = 0, rule: str = "paper", *,
                 p_layer: tuple[float, ...] | None = None, anneal_steps: int = 0) -> None:
        self.layers = layer_specs(model.config)
        if p_layer is not None:
            p_layer = check_p_layer(p_layer, len(self.layers), "p_layer")
        self.config = RoutingConfig(check_p(p), seed, rule, p_layer, anneal_steps)
        self.model = model
        self.rule: RoutingRule = RULES.get(rule)
        self.rng = random.Random(seed)
        self._teacher = False  # inside own_kv_pass: every layer on its own K/V, no draw consumed
        self.draws: list[SharingPattern] = []  # this object's draws, one per forward pass, in order
        self.drawn = 0  # draws since the seed, including those of the run this one was loaded from
        self._ctx: Any = None

    def current_p(self) -> tuple[float, ...]:
        """Per-layer p of the next draw (the schedule counts draws since the seed, so it continues on resume)."""
        target = self.config.p_layer or (self.config.p,) * len(self.layers)
        return annealed_p(target, self.drawn, self.config.anneal_steps)

    @contextmanager
    def own_kv_pass(self) -> Iterator[None]:
        """Forward passes in this block keep every layer on its own K/V and consume no draw (nor log one)."""
        self._teacher = True
        try:
            yield
        finally:
            self._teacher = False

    def _draw(self) -> SharingPattern:
        if self._teacher:
            return none(self.layers)
        pattern = self.rule.draw(self.layers, self.current_p(), self.rng)
        self.draws.append(pattern)
        self.drawn += 1
        return pattern

    def counts(self) -> Counter[str]:
        """How often each route was drawn by this object (compact string form, e.g. ``"0_0_1_2"``)."""
        return Counter(format_pattern(d) for d in self.draws)

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue the same draws, as JSON-serialisable values."""
        version, internal, gauss = self.rng.getstate()
        p_layer = None if self.config.p_layer is None else list(self.config.p_layer)
        return {"p": self.config.p, "seed": self.config.seed, "rule": self.config.rule, "draws": self.drawn,
                "p_layer": p_layer, "anneal_steps": self.config.anneal_steps, "rng": [version, list(internal), gauss]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`; :class:`PatternError` if it is malformed or was saved with another
        p, seed, rule, p_layer or anneal_steps (a resumed run must draw from the same distribution and stream).
        A state saved before p_layer / anneal_steps existed had neither."""
        try:
            p_layer = state.get("p_layer")
            saved = (float(state["p"]), state["seed"], state["rule"],
                     None if p_layer is None else tuple(float(v) for v in p_layer), int(state.get("anneal_steps", 0)))
            version, internal, gauss = state["rng"]
            rng_state = (int(version), tuple(int(x) for x in internal), None if gauss is None else float(gauss))
            drawn = int(state["draws"])
            probe = random.Random()
            probe.setstate(rng_state)
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise PatternError(f"routing state is not a StochasticKVRouting.state_dict() ({type(exc).__name__}: "
                               f"{exc}); resume from an intact training state") from None
        mine = (self.config.p, self.config.seed, self.config.rule, self.config.p_layer, self.config.anneal_steps)
        for name, old, new in zip(("p", "seed", "rule", "p_layer", "anneal_steps"), saved, mine, strict=True):
            if old != new:
                raise PatternError(f"routing state was saved with {name}={old!r} but this routing has {name}={new!r}; "
                                   f"resume with {name}={old!r} or start a new run")
        self.rng.setstate(rng_state)
        self.drawn = drawn

    def __enter__(self) -> StochasticKVRouting:
        self._ctx = routed(self.model, self._draw, own_kv=self.rule.own_kv)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        ctx, self._ctx = self._ctx, None
        ctx.__exit__(*exc)


__all__ = ["RULES", "RoutingConfig", "StochasticKVRouting"]  # RULES: the registry (kvstate.depth.registry)
