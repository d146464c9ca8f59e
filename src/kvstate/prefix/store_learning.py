"""Learning where requests overlap, for the prefix store's checkpoint plans (pure; no torch).

Sparse prefix caching ("Sparse Prefix Caching for Hybrid and Recurrent LLM Serving") plans checkpoints
from the distribution of overlap depths. The store records every request's true overlap on the radix tree
(mass on nodes, plus store-wide depth and tail counts) and turns what was seen along a request's path into
the weights its planner uses — per path, or over a bounded subtree with the exact tree placement
(:mod:`kvstate.prefix.tree_plan`). Boundaries a request declares (the end of a document, of each chat
message) are pseudo-observations on that request's weights and compete with the planned positions for its
slots (:meth:`OverlapLearning._with_boundaries`).

Learning is transactional: a request's observation is applied while it is planned and undone right
after; the store applies it for good when the request commits (``_observe`` returns the undo).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kvstate.prefix import tree_plan
from kvstate.prefix.placement import plan_among
from kvstate.prefix.store_types import FloatArray, Node, StoreConfig

Undo = Callable[[], None]


class OverlapLearning:
    """Mixed into :class:`kvstate.prefix.store.PrefixStore`, which owns the tree and the counts."""

    config: StoreConfig
    root: Node
    _prior: dict[int, float]  # store-wide observed overlap depths (plans paths with no history)
    _tails: dict[int, float]  # store-wide: tokens after the overlap, of requests that had one

    def _path_weights(self, path: list[Node], t: int, n: int, declared: tuple[int, ...] = ()) -> FloatArray:
        """Overlap mass seen along the request's path: requests ending on it, or branching off it, at depth d;
        plus one pseudo-observation at each ``declared`` boundary."""
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
        for b in declared:  # the caller says requests will part here: as much as one request seen doing so
            w[b] += 1.0
        if prior.sum() > 0:
            w += prior / prior.sum()
        elif w[1:].sum() <= 0:
            w = np.ones(n + 1)  # nothing known at all: spread the checkpoints evenly
        w[max(n - 1, 0) :] = 0.0  # the end state serves overlaps of n-1 and n for free
        return w if w.sum() > 0 else np.ones(n + 1)

    def _observe(self, path: list[Node], t: int, n: int) -> Undo:
        """Record one request of ``n`` tokens overlapping the store by ``t`` along ``path`` (the nodes it
        passes below depth ``t``); returns what restores the counts exactly as they were."""
        saved_prior, saved_tail = self._prior.get(t), self._tails.get(n - t) if t > 0 else None
        saved_sub = [(v, v.sub_mass) for v in (self.root, *path)]
        last = path[-1] if t > 0 and path else None
        saved_mass = last.mass.get(t) if last is not None else None
        self._prior[t] = self._prior.get(t, 0.0) + 1.0
        if t > 0:
            self._tails[n - t] = self._tails.get(n - t, 0.0) + 1.0
        for v, _ in saved_sub:
            v.sub_mass += 1.0
        if last is not None:
            last.mass[t] = last.mass.get(t, 0.0) + 1.0

        def undo() -> None:
            _restore(self._prior, t, saved_prior)
            if t > 0:
                _restore(self._tails, n - t, saved_tail)
            for v, old in saved_sub:
                v.sub_mass = old
            if last is not None:
                _restore(last.mass, t, saved_mass)

        return undo

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

    def _tree_plan(self, path: list[Node], t: int, n: int) -> tuple[list[int], tuple[tree_plan.Stamp, ...] | None]:
        """Tree placement: the standing plan on the path, or a fresh exact plan of its subtree on drift
        (with the stamps to apply on commit; None: no re-plan)."""
        c = self.config
        if not tree_plan.needs_plan(path, t, c.tree.drift):
            return [p for p in tree_plan.planned_on_path(path, t) if 0 < p < n - 1], None
        built = self.tree_for(path, t, n)
        return tree_plan.apply(built, tree_plan.solve(built), t, n)

    def _with_boundaries(
        self, plan: list[int], declared: tuple[int, ...], path: list[Node], t: int, n: int
    ) -> tuple[list[int], tuple[int, ...]]:
        """The request's checkpoints with its declared boundaries: all of the planned positions and the
        boundaries while they fit in its slots (``slots_per_entry``, or the tree plan's points on the path
        when more); beyond that, the best that many of them under the planner's objective (expected
        recompute on the path's weights with the boundaries' pseudo-observations, exact over these
        candidates) — a boundary takes a planned position's slot only when that lowers the expected
        recompute. Returns the positions and the boundaries among them."""
        free = [b for b in declared if 0 < b < n - 1]  # n-1 and n: the end state serves them anyway
        if not free:
            return plan, ()
        slots = max(self.config.slots_per_entry, len(plan))
        union = sorted(set(plan) | set(free))
        chosen = union if len(union) <= slots else plan_among(self._path_weights(path, t, n, tuple(free)), union, slots)
        return chosen, tuple(b for b in free if b in chosen)

    def tree_for(self, path: list[Node], t: int, n: int) -> tree_plan.BuiltTree:
        """The bounded subtree the tree placement plans for this request (no mutation)."""
        c = self.config
        return tree_plan.build(self.root, path, t, n, self._new_part(t, n), c.slots_per_entry, c.align, c.tree)


def _restore(counts: dict[int, float], key: int, old: float | None) -> None:
    if old is None:
        counts.pop(key, None)
    else:
        counts[key] = old
