"""Learning where requests overlap, for the prefix store's checkpoint plans (pure; no torch).

Sparse prefix caching ("Sparse Prefix Caching for Hybrid and Recurrent LLM Serving") plans checkpoints
from the distribution of overlap depths. The store records every request's true overlap on the radix tree
(mass on nodes, plus store-wide depth and tail counts) and turns what was seen along a request's path into
the weights its planner uses — per path, or over a bounded subtree with the exact tree placement
(:mod:`kvstate.prefix.tree_plan`).
"""

from __future__ import annotations

import numpy as np

from kvstate.prefix import tree_plan
from kvstate.prefix.store_types import FloatArray, Node, StoreConfig


class OverlapLearning:
    """Mixed into :class:`kvstate.prefix.store.PrefixStore`, which owns the tree and the counts."""

    config: StoreConfig
    root: Node
    _prior: dict[int, float]  # store-wide observed overlap depths (plans paths with no history)
    _tails: dict[int, float]  # store-wide: tokens after the overlap, of requests that had one

    def _path_weights(self, path: list[Node], t: int, n: int) -> FloatArray:
        """Overlap mass seen along the request's path: requests ending on it, or branching off it, at depth d."""
        w = np.zeros(n + 1)
        w[0] = self.root.sub_mass - sum(v.sub_mass for v in path[:1])
        for i, v in enumerate(path):
            own = 0.0
            for d, m in v.mass.items():
                w[min(d, t)] += m
                own += m
            below = path[i + 1].sub_mass if i + 1 < len(path) else 0.0
            w[min(v.depth, t)] += max(v.sub_mass - own - below, 0.0)
        # the request's new part (beyond t) has no history of its own: one pseudo-observation spread like
        # the store's overlaps, both in absolute depth (system prompts) and as a distance from the request's
        # end (a document followed by a question: the next question diverges where this one starts)
        prior = self._overlap_prior(t, n)
        if prior.sum() > 0:
            w += prior / prior.sum()
        elif w[1:].sum() <= 0:
            w = np.ones(n + 1)  # nothing known at all: spread the checkpoints evenly
        w[max(n - 1, 0) :] = 0.0  # the end state serves overlaps of n-1 and n for free
        return w if w.sum() > 0 else np.ones(n + 1)

    def _observe(self, path: list[Node], t: int, n: int) -> None:
        self._prior[t] = self._prior.get(t, 0.0) + 1.0
        if t > 0:
            self._tails[n - t] = self._tails.get(n - t, 0.0) + 1.0
        self.root.sub_mass += 1.0
        for v in path:
            v.sub_mass += 1.0
        if t > 0:
            last = path[-1]
            last.mass[t] = last.mass.get(t, 0.0) + 1.0

    def _overlap_prior(self, t: int, n: int) -> FloatArray:
        """Store-wide overlaps mapped onto a new part ``(t, n)``: absolute depths and distances from the end."""
        prior = np.zeros(n + 1)
        for d, m in self._prior.items():
            if t < d < n:
                prior[d] += m
        for k, m in self._tails.items():
            if t < n - k < n:
                prior[n - k] += m
        return prior

    def _new_part(self, t: int, n: int) -> FloatArray:
        """One pseudo-observation over the request's new part ``(t, n)`` spread like the store's overlaps."""
        prior = self._overlap_prior(t, n)
        if prior.sum() <= 0:  # nothing known: spread evenly (as the path planner does)
            prior[t + 1 : n - 1] = 1.0
        return prior / prior.sum() if prior.sum() > 0 else prior

    def _tree_plan(self, path: list[Node], t: int, n: int) -> tuple[list[int], bool]:
        """Tree placement: the standing plan on the path, or a fresh exact plan of its subtree on drift."""
        c = self.config
        if not tree_plan.needs_plan(path, t, c.tree.drift):
            return [p for p in tree_plan.planned_on_path(path, t) if 0 < p < n - 1], False
        built = self.tree_for(path, t, n)
        return tree_plan.apply(built, tree_plan.solve(built), t, n), True

    def tree_for(self, path: list[Node], t: int, n: int) -> tree_plan.BuiltTree:
        """The bounded subtree the tree placement plans for this request (no mutation)."""
        c = self.config
        return tree_plan.build(self.root, path, t, n, self._new_part(t, n), c.slots_per_entry, c.align, c.tree)
