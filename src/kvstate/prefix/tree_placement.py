"""Checkpoint placement over a prefix *tree* with one shared slot budget — beyond the sparse prefix caching paper.

Seed 000 places ``M`` recurrent-state checkpoints inside one prefix and names general prefix trees as
open work. Here the cached prefixes form a radix tree and one budget is shared by all of it.

Representation (:class:`PrefixTree`, pure): nodes ``0..V-1``, node 0 the root (depth 0, no edge);
``parent[v] < v`` for ``v >= 1``; ``edge_len[v] >= 1`` tokens lie on the edge from ``parent[v]`` to
``v``, i.e. absolute depths ``top(v)+1 .. end(v)`` with ``top(v) = end(parent[v])``.
``mass[v][i]`` is the probability (or count) that a request's overlap path *ends* at depth
``top(v)+i+1`` on that edge; ``root_mass`` is the mass of requests that overlap nothing. A checkpoint
is a point ``(v, c)`` with ``top(v) < c <= end(v)`` and ``c`` a multiple of ``align``; it serves every
request whose path passes depth ``c`` on edge ``v`` — those ending on the edge at depth ``>= c`` and
everything in ``v``'s subtree. A request restores the deepest checkpoint on its path at or above
it and recomputes the rest, as in the single-prefix model.

Exact DP (:func:`plan_tree`). Savings telescope as on a line: a checkpoint at depth ``c`` whose
nearest checkpoint above is at ``a`` saves ``(c - a) * G(c)``, ``G(c)`` = mass at or below the point.
With ``F_v[a, k]`` the best savings in ``v``'s edge and subtree using at most ``k`` checkpoints when
the nearest checkpoint above the edge is at depth ``a`` (``a`` ranges over the grid depths
``<= top(v)``), ``H_v[b, k]`` the same for ``v``'s children given a checkpoint at ``b`` (a max-plus
knapsack over children), and ``T_v[j, k]`` the savings strictly below the ``j``-th candidate of the
edge given a checkpoint there::

    T_v[j, k] = max(H_v[p_j, k],  max_{j' > j} (p_j' - p_j) G(p_j') + T_v[j', k-1])
    F_v[a, k] = max(H_v[a, k],    max_j       (p_j  - a)  G(p_j)  + T_v[j,  k-1])

Cost ``O(sum_v (L_v^2 + A_v L_v) M + A_v C_v M^2)`` with ``L_v`` grid points on edge ``v``, ``A_v``
grid depths above it and ``C_v`` children — meant for trees of hundreds of nodes, not for 10^5-token
edges (use the line planner per edge for those). Baseline :func:`plan_independent` treats every
root-to-leaf path as its own entry (mass at shared points split among the leaves below in proportion
to their subtree mass), gives each entry a share of the budget proportional to its mass (largest
remainder) and plans each optimally on its own; points chosen by several entries count once per
entry against the budget, as separate entries would store them.

Ignores: admission/eviction and token identities (a node is just an edge length and its masses).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from kvstate.prefix.placement import plan_checkpoints

FloatArray = npt.NDArray[np.float64]
TreePoint = tuple[int, int]  # (node whose edge holds the checkpoint, absolute depth)


@dataclass(frozen=True, eq=False)
class PrefixTree:
    """A radix tree of token edges with per-depth overlap mass (see module docstring)."""

    parent: tuple[int, ...]  # parent[v] < v; parent[0] == -1 (root)
    edge_len: tuple[int, ...]  # tokens on the edge into v; 0 for the root, >= 1 otherwise
    mass: tuple[FloatArray, ...]  # mass[v][i]: overlap ends at depth top(v) + i + 1; len == edge_len[v]
    root_mass: float = 0.0  # requests that overlap nothing (depth 0)
    top: tuple[int, ...] = field(init=False)  # absolute depth where the edge into v starts
    children: tuple[tuple[int, ...], ...] = field(init=False)

    def __post_init__(self) -> None:
        v_count = len(self.parent)
        if v_count == 0 or self.parent[0] != -1:
            raise ValueError("parent: node 0 must be the root with parent[0] == -1")
        if len(self.edge_len) != v_count or len(self.mass) != v_count:
            raise ValueError(
                f"edge_len/mass: need one entry per node ({v_count}), got {len(self.edge_len)} and {len(self.mass)}"
            )
        top = [0] * v_count
        kids: list[list[int]] = [[] for _ in range(v_count)]
        for v in range(1, v_count):
            p = self.parent[v]
            if not 0 <= p < v:
                raise ValueError(
                    f"parent[{v}]: must be a node id in 0..{v - 1} (parents precede children), got {p}"
                )
            if self.edge_len[v] < 1:
                raise ValueError(f"edge_len[{v}]: a non-root edge holds >= 1 token, got {self.edge_len[v]}")
            top[v] = top[p] + self.edge_len[p]
            kids[p].append(v)
        if self.edge_len[0] != 0:
            raise ValueError(f"edge_len[0]: the root has no edge, must be 0, got {self.edge_len[0]}")
        masses = []
        for v, m in enumerate(self.mass):
            a = np.asarray(m, dtype=np.float64)
            if a.shape != (self.edge_len[v],):
                raise ValueError(
                    f"mass[{v}]: expected shape ({self.edge_len[v]},) (one weight per edge token), got {a.shape}"
                )
            if not np.all(np.isfinite(a)) or np.any(a < 0):
                raise ValueError(f"mass[{v}]: weights must be finite and >= 0")
            masses.append(a)
        if not (np.isfinite(self.root_mass) and self.root_mass >= 0):
            raise ValueError(f"root_mass: must be finite and >= 0, got {self.root_mass!r}")
        if self.root_mass + sum(float(a.sum()) for a in masses) <= 0:
            raise ValueError("mass: the tree carries no request mass; pass some positive weights")
        object.__setattr__(self, "mass", tuple(masses))
        object.__setattr__(self, "top", tuple(top))
        object.__setattr__(self, "children", tuple(tuple(k) for k in kids))

    @property
    def size(self) -> int:
        return len(self.parent)

    def end(self, v: int) -> int:
        """Absolute depth at the end of the edge into ``v``."""
        return self.top[v] + self.edge_len[v]

    def subtree_mass(self) -> FloatArray:
        """Mass on each node's edge plus everything below it."""
        sub = np.array([float(m.sum()) for m in self.mass])
        for v in range(self.size - 1, 0, -1):
            sub[self.parent[v]] += sub[v]
        return sub


def _check(tree: PrefixTree, slots: int, align: int) -> None:
    if isinstance(slots, bool) or not isinstance(slots, (int, np.integer)) or slots < 0:
        raise ValueError(f"slots: must be an int >= 0 (checkpoints shared by the whole tree), got {slots!r}")
    if isinstance(align, bool) or not isinstance(align, (int, np.integer)) or align < 1:
        raise ValueError(
            f"align: must be an int >= 1 (checkpoint depths are multiples of align), got {align!r}"
        )


def tree_expected_recompute(tree: PrefixTree, checkpoints: list[TreePoint]) -> float:
    """Expected tokens recomputed per request (mass-weighted, root_mass included in the total)."""
    own: list[list[int]] = [[] for _ in range(tree.size)]
    for v, c in checkpoints:
        if not (0 < v < tree.size and tree.top[v] < c <= tree.end(v)):
            raise ValueError(
                f"checkpoints: ({v}, {c}) is not a point on an edge; need top(v) < depth <= end(v)"
            )
        own[v].append(c)
    above = [0] * tree.size  # deepest checkpoint at or above the top of each edge
    cost = 0.0
    for v in range(1, tree.size):
        cs = np.array(sorted(set(own[v])), dtype=np.int64)
        depth = np.arange(tree.top[v] + 1, tree.end(v) + 1)
        served = np.concatenate(([above[v]], cs))[np.searchsorted(cs, depth, side="right")]
        cost += float(np.dot(tree.mass[v], depth - served))
        for u in tree.children[v]:
            above[u] = int(cs[-1]) if cs.size else above[v]
    total = tree.root_mass + sum(float(m.sum()) for m in tree.mass)
    return cost / total


def plan_tree(tree: PrefixTree, slots: int, align: int = 1) -> list[TreePoint]:
    """Exact optimal placement of at most ``slots`` checkpoints over the whole tree (sorted points)."""
    _check(tree, slots, align)
    m = int(slots)
    total = tree.root_mass + sum(float(a.sum()) for a in tree.mass)
    sub = tree.subtree_mass() / total
    F: dict[int, FloatArray] = {}  # F[v][ia, k]; ia indexes grid depths 0, align, ... <= top(v)
    f_arg: dict[int, npt.NDArray[np.int64]] = {}  # -1: no checkpoint on the edge, else candidate j
    t_arg: dict[int, npt.NDArray[np.int64]] = {}  # T choice: -1 stop (hand over to children), else j'
    splits: dict[int, list[npt.NDArray[np.int64]]] = {}  # knapsack: budget of the i-th child
    cands: dict[int, npt.NDArray[np.int64]] = {}
    for v in range(tree.size - 1, -1, -1):  # children before parents
        n_b = tree.end(v) // align + 1  # grid depths <= end(v) a child can inherit
        h = np.zeros((n_b, m + 1))
        splits[v] = []
        for u in tree.children[v]:  # max-plus knapsack over children
            fu = F.pop(u)
            merged = h[:, :, None] + fu[:, None, :]  # (b, k_sofar, k_child)
            best = np.full_like(h, -np.inf)
            arg = np.zeros(h.shape, dtype=np.int64)
            for k in range(m + 1):
                diag = merged[:, np.arange(k, -1, -1), np.arange(k + 1)]  # k_sofar + k_child = k
                arg[:, k] = np.argmax(diag, axis=1)
                best[:, k] = diag[np.arange(n_b), arg[:, k]]
            h = best
            splits[v].append(arg)
        if v == 0:
            F[0] = h
            break
        lo, hi = tree.top[v], tree.end(v)
        p = np.arange(-(-(lo + 1) // align) * align, hi + 1, align)  # grid points on this edge
        cands[v] = p
        # G(c): mass at depths >= c on this edge plus the whole subtree; edge[i] = G(lo + 1 + i)
        edge = sub[v] - np.concatenate(([0.0], np.cumsum(tree.mass[v] / total)))
        g = edge[p - lo - 1]
        n_a = lo // align + 1
        f = h[:n_a].copy()
        fa = np.full((n_a, m + 1), -1, dtype=np.int64)
        if p.size and m:
            t = h[p // align].copy()  # (L, m+1): stop here, children inherit p_j
            ta = np.full(t.shape, -1, dtype=np.int64)
            for j in range(p.size - 2, -1, -1):
                gain = ((p[j + 1 :] - p[j]) * g[j + 1 :])[:, None] + t[j + 1 :, :-1]  # (j', k-1)
                jj = np.argmax(gain, axis=0)
                val = gain[jj, np.arange(m)]
                better = val > t[j, 1:]
                t[j, 1:] = np.where(better, val, t[j, 1:])
                ta[j, 1:] = np.where(better, jj + j + 1, -1)
            a = np.arange(n_a) * align
            for k in range(1, m + 1):
                gain = (p[None, :] - a[:, None]) * g[None, :] + t[None, :, k - 1]  # (a, j)
                jj = np.argmax(gain, axis=1)
                val = gain[np.arange(n_a), jj]
                better = val > f[:, k]
                f[:, k] = np.where(better, val, f[:, k])
                fa[:, k] = np.where(better, jj, -1)
            t_arg[v] = ta
        F[v], f_arg[v] = f, fa
    return sorted(_reconstruct(tree, m, align, cands, f_arg, t_arg, splits))


def _reconstruct(
    tree: PrefixTree,
    m: int,
    align: int,
    cands: dict[int, npt.NDArray[np.int64]],
    f_arg: dict[int, npt.NDArray[np.int64]],
    t_arg: dict[int, npt.NDArray[np.int64]],
    splits: dict[int, list[npt.NDArray[np.int64]]],
) -> list[TreePoint]:
    out: list[TreePoint] = []
    todo: list[tuple[str, int, int, int]] = [("kids", 0, 0, m)]  # (kind, node, grid index, budget)
    while todo:
        kind, v, ia, k = todo.pop()
        if kind == "kids":
            for i in range(len(tree.children[v]) - 1, -1, -1):
                k_child = int(splits[v][i][ia, k])
                todo.append(("edge", tree.children[v][i], ia, k_child))
                k -= k_child
            continue
        j = int(f_arg[v][ia, k])
        if j < 0:
            todo.append(("kids", v, ia, k))
            continue
        p = cands[v]
        while True:  # walk down the edge's chosen candidates
            out.append((v, int(p[j])))
            k -= 1
            nxt = int(t_arg[v][j, k])
            if nxt < 0:
                todo.append(("kids", v, int(p[j]) // align, k))
                break
            j = nxt
    return out


def plan_independent(tree: PrefixTree, slots: int, align: int = 1) -> list[TreePoint]:
    """Baseline: each root-to-leaf path planned as its own entry with a mass-proportional budget share."""
    _check(tree, slots, align)
    sub = tree.subtree_mass()
    share = np.ones(tree.size)  # fraction of the mass reaching parent[v] that continues into v
    for v in range(tree.size):
        kids = tree.children[v]
        below = float(sum(sub[u] for u in kids))
        for u in kids:
            share[u] = sub[u] / below if below > 0 else 1.0 / len(kids)
    paths, entries = [], []
    for leaf in range(1, tree.size):
        if tree.children[leaf]:
            continue
        path = [leaf]
        while path[-1] != 0:
            path.append(tree.parent[path[-1]])
        path.reverse()  # root .. leaf
        w = np.zeros(tree.end(leaf) + 1)  # this entry's line distribution over depths 0..end(leaf)
        route = 1.0  # probability that mass at the current node continues down to this leaf
        for v in reversed(path):
            if v == 0:
                w[0] = tree.root_mass * route
            else:
                w[tree.top[v] + 1 : tree.end(v) + 1] = tree.mass[v] * route
            route *= share[v]
        paths.append(path)
        entries.append(w)
    mass = np.array([w.sum() for w in entries])
    quota = slots * mass / mass.sum() if mass.sum() > 0 else np.zeros(mass.size)
    budget = np.floor(quota).astype(np.int64)
    order = np.argsort(-(quota - budget), kind="stable")
    budget[order[: int(slots) - int(budget.sum())]] += 1  # largest remainder
    out: set[TreePoint] = set()
    for path, w, k in zip(paths, entries, budget, strict=True):
        if k == 0 or w.size - 1 < align or w[1:].sum() <= 0:
            continue
        for c in plan_checkpoints(w, int(k), "optimal", align):
            node = next(v for v in path[1:] if tree.top[v] < c <= tree.end(v))
            out.add((node, c))
    return sorted(out)
