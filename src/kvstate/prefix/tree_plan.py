"""Placement over the store's radix tree: the exact tree DP on a bounded subtree, re-planned lazily (pure).

Sparse prefix caching ("Sparse Prefix Caching for Hybrid and Recurrent LLM Serving") plans checkpoints
inside one prefix; ``tree_placement.py`` solves the tree version exactly (one slot budget shared by a
prefix tree). This module applies that solver inside :class:`kvstate.prefix.store.PrefixStore`
(``placement="tree"``) with a per-request cost bounded by constants, not by the number of entries:

- **Subtree.** The tree handed to ``plan_tree`` holds the root, the request's path, and the whole subtree
  of the highest path node whose subtree fits in ``max_nodes`` nodes (with the path above it); when even
  the last path node's subtree is larger (a document with many questions), the heaviest nodes below it
  (largest observed mass first, scanning at most ``SCAN`` children per node) up to the cap. Other
  branches are not re-planned for this request: their slots are theirs. A child left out is collapsed onto its
  parent: its mass counts as overlaps ending at the parent's end (a checkpoint there serves them; the
  savings deeper down are not counted, so the plan is conservative for them). The request's own node is
  cut virtually at its overlap depth ``t`` and its new part ``(t, n]`` is a virtual leaf carrying one
  pseudo-observation spread like the store's overlaps (as the path planner does).
- **Budget.** ``min(slots_per_entry × leaves of that tree, max_slots)`` checkpoints shared by the tree;
  end states (depths ``L-1``, ``L`` of a stored request) are free, so mass they already serve is zeroed.
- **Grid.** Depths are multiples of ``align``, coarsened to ``align × k`` so the deepest node has at
  most ``max_grid`` grid points; the DP's cost is then bounded by the three caps.
- **Laziness.** A plan is stamped on every node it covered with the node's mass at planning time. A
  request re-plans only when one of its path's nodes was never planned (new or cut), when it leaves its
  path part-way along an edge (a new branch point, where the next request will want a checkpoint), or when the
  distribution of its path's mass (per path node: mass ending on its edge, mass passing beyond it
  elsewhere) moved by more than ``drift`` in total variation since the stamps; otherwise it captures the
  planned points on its path. Cost of the check: the path's length in nodes.

Ignores: where on an edge new mass lands between re-plans (only per-node totals are compared).
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from kvstate.prefix.tree_placement import PrefixTree, TreePoint, plan_tree

if TYPE_CHECKING:
    from kvstate.prefix.store import Node

FloatArray = npt.NDArray[np.float64]
SCAN = 256  # children looked at per node when growing the subtree (bounds the cost for wide nodes)


@dataclass(frozen=True)
class TreeLimits:
    max_nodes: int = 32  # nodes of the tree handed to the exact DP (root and the request's path included)
    max_slots: int = 32  # checkpoints shared by that tree
    max_grid: int = 64  # grid points along the deepest path (the alignment is coarsened to fit)
    drift: float = 0.1  # total-variation change of the path's mass that triggers a re-plan

    def __post_init__(self) -> None:
        if self.max_nodes < 2 or self.max_slots < 0 or self.max_grid < 1 or not 0.0 <= self.drift <= 1.0:
            raise ValueError(
                f"tree limits: need max_nodes >= 2, max_slots >= 0, max_grid >= 1, 0 <= drift <= 1; got {self}"
            )


@dataclass(frozen=True)
class BuiltTree:
    tree: PrefixTree
    owner: tuple[Node | None, ...]  # real store node of each tree node (None: the root or the virtual leaf)
    covered: tuple[Node, ...]  # real nodes whose plans this tree replaces
    slots: int
    align: int
    leaf: int  # index of the virtual leaf holding the request's new part (-1: none)
    on_path: frozenset[int]  # tree nodes on the request's matched path (the root excluded)


def _path_shares(path: list[Node], stamped: bool) -> FloatArray:
    """Per path node: (mass ending on its edge, mass passing beyond it off the path), normalised."""
    out = []
    for i, v in enumerate(path):
        sub = v.plan_sub if stamped else v.sub_mass
        own = v.plan_own if stamped else sum(v.mass.values())
        nxt = path[i + 1] if i + 1 < len(path) else None
        below = (nxt.plan_sub if stamped else nxt.sub_mass) if nxt is not None else 0.0
        out += [own, max((sub or 0.0) - own - (below or 0.0), 0.0)]
    a = np.asarray(out, dtype=np.float64)
    return a / a.sum() if a.sum() > 0 else a


def needs_plan(path: list[Node], t: int, drift: float) -> bool:
    """True when the request's path was never planned as it is now (new or cut nodes, or the request
    leaves it part-way along an edge: a new branch point), or its mass drifted (see module doc)."""
    if not path or t < path[-1].depth or any(v.plan_sub is None for v in path):
        return True
    before, now = _path_shares(path, True), _path_shares(path, False)
    if before.sum() <= 0:
        return bool(now.sum() > 0)
    return bool(0.5 * np.abs(before - now).sum() > drift)


def planned_on_path(path: list[Node], t: int) -> list[int]:
    """The standing plan's points on the request's matched path (depths <= t)."""
    return sorted(p for v in path for p in v.planned if v.top < p <= min(v.depth, t))


def _count(v: Node, limit: int) -> int:
    """Nodes in ``v``'s subtree (``v`` included), counting no further than ``limit + 1``."""
    seen, stack = 0, [v]
    while stack and seen <= limit:
        u = stack.pop()
        seen += 1
        stack.extend(itertools.islice(u.children.values(), limit + 1))
    return seen


def _grow(root: Node, path: list[Node], max_nodes: int) -> list[Node]:
    """The root, the path, and the subtree of the highest path node that fits in ``max_nodes`` — or, when
    none fits, the heaviest nodes below the path's last node up to the cap."""
    chosen = [root, *path]
    seen = {id(v) for v in chosen}
    for i, v in enumerate(path):
        if i + 1 + _count(v, max_nodes - i - 1) <= max_nodes:
            stack = list(v.children.values())
            while stack:
                u = stack.pop()
                if id(u) not in seen:
                    seen.add(id(u))
                    chosen.append(u)
                stack.extend(u.children.values())
            return chosen
    tie = itertools.count()
    heap: list[tuple[float, int, Node]] = []

    def offer(v: Node) -> None:
        for u in itertools.islice(v.children.values(), SCAN):
            if id(u) not in seen:
                heapq.heappush(heap, (-u.sub_mass, next(tie), u))

    if path:
        offer(path[-1])
    while heap and len(chosen) < max_nodes:
        _, _, u = heapq.heappop(heap)
        seen.add(id(u))
        chosen.append(u)
        offer(u)
    return chosen


def _edge_mass(v: Node, lo: int, hi: int) -> FloatArray:
    """Observed mass of ``v`` at depths ``lo+1..hi``, zero where an end state already serves it."""
    m = np.zeros(hi - lo)
    for d, x in v.mass.items():
        if lo < d <= hi:
            m[d - lo - 1] += x
    for p, s in v.states.items():
        for d in (p, p + 1):
            if s.end and lo < d <= hi:
                m[d - lo - 1] = 0.0
    return m


def build(
    root: Node,
    path: list[Node],
    t: int,
    n: int,
    new_part: FloatArray,
    slots_per_entry: int,
    align: int,
    limits: TreeLimits,
) -> BuiltTree:
    """The subtree to plan for a request of ``n`` tokens overlapping the store by ``t`` (see module doc).
    ``new_part[d]`` for ``t < d < n - 1``: pseudo-mass of the request's new part (depths ``n-1, n`` are free)."""
    nodes = sorted(_grow(root, path, limits.max_nodes), key=lambda v: (v.depth, v.id))
    last = path[-1] if path else root
    cut = last if path and t < last.depth else None  # the request leaves `cut`'s edge part-way
    parent: list[int] = [-1]
    edge: list[int] = [0]
    mass: list[FloatArray] = [np.zeros(0)]
    owner: list[Node | None] = [None]
    index: dict[int, int] = {id(root): 0}  # real node → tree node its children hang from
    top_of: dict[int, int] = {}  # tree node where a real node's edge starts (differs only for `cut`)
    included = {id(v) for v in nodes}

    def add(p: int, length: int, m: FloatArray, who: Node | None) -> int:
        parent.append(p)
        edge.append(length)
        mass.append(m)
        owner.append(who)
        return len(parent) - 1

    for v in nodes[1:]:
        assert v.parent is not None
        p = index[id(v.parent)]
        kept = sum(u.sub_mass for u in v.children.values() if id(u) in included)
        rest = max(v.sub_mass - sum(v.mass.values()) - kept, 0.0)  # collapsed children and branches
        if v is cut:
            upper = add(p, t - v.top, _edge_mass(v, v.top, t), v)
            top_of[id(v)] = upper
            low = _edge_mass(v, t, v.depth)
            low[-1] += rest
            index[id(v)] = add(upper, v.depth - t, low, v)
        else:
            m = _edge_mass(v, v.top, v.depth)
            m[-1] += rest
            index[id(v)] = top_of[id(v)] = add(p, len(v.edge), m, v)
    leaf = -1
    if n > t:
        hang = top_of[id(cut)] if cut is not None else index[id(last)]
        m = np.zeros(n - t)
        m[: n - t] = new_part[t + 1 : n + 1]
        m[max(n - 1 - t - 1, 0) :] = 0.0  # depths n-1 and n: the end state serves them
        leaf = add(hang, n - t, m, None)
    kept_root = sum(u.sub_mass for u in root.children.values() if id(u) in included)
    root_mass = max(root.sub_mass - kept_root, 0.0)
    if root_mass + sum(float(x.sum()) for x in mass) <= 0:
        root_mass = 1.0  # nothing observed yet: the DP needs some mass (it then places nothing useful)
    tree = PrefixTree(tuple(parent), tuple(edge), tuple(mass), root_mass=root_mass)
    leaves = sum(1 for v in range(1, tree.size) if not tree.children[v])
    deepest = max(tree.end(v) for v in range(tree.size))
    step = align * max(1, math.ceil(deepest / (align * limits.max_grid)))
    slots = min(slots_per_entry * max(leaves, 1), limits.max_slots)
    on_path = frozenset(top_of[id(v)] for v in path)
    return BuiltTree(tree, tuple(owner), tuple(nodes[1:]), slots, step, leaf, on_path)


def solve(built: BuiltTree) -> list[TreePoint]:
    """The exact optimal placement on the built tree (``tree_placement.plan_tree``)."""
    return plan_tree(built.tree, built.slots, built.align) if built.slots else []


@dataclass(frozen=True)
class Stamp:
    """A covered node's new plan and the mass it was made for (applied when the request commits)."""

    node: Node
    planned: frozenset[int]  # planned checkpoint positions on the node's edge
    plan_sub: float  # the node's sub_mass when planned
    plan_own: float  # the node's own mass when planned


def apply(built: BuiltTree, points: list[TreePoint], t: int, n: int) -> tuple[list[int], tuple[Stamp, ...]]:
    """The request's positions among ``points`` and the stamps replacing the covered nodes' plans; nothing
    is mutated (:func:`stamp` applies the stamps)."""
    planned: dict[int, set[int]] = {id(v): set() for v in built.covered}
    mine: list[int] = []
    for tv, c in points:
        who = built.owner[tv]
        if who is not None:
            planned.setdefault(id(who), set()).add(c)
            if tv in built.on_path and c <= t:
                mine.append(c)
        elif tv == built.leaf:
            mine.append(c)
    stamps = tuple(
        Stamp(v, frozenset(planned[id(v)]), v.sub_mass, sum(v.mass.values())) for v in built.covered
    )
    return sorted(p for p in set(mine) if 0 < p < n - 1), stamps


def stamp(stamps: tuple[Stamp, ...]) -> None:
    """Replace the stamped nodes' plans (see :func:`apply`)."""
    for s in stamps:
        s.node.planned = set(s.planned)
        s.node.plan_sub = s.plan_sub
        s.node.plan_own = s.plan_own
