"""Prefix-tree checkpoint placement with one slot budget: exact DP against brute force on small trees."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from kvstate.prefix.placement import expected_recompute, plan_checkpoints
from kvstate.prefix.tree_placement import PrefixTree, plan_independent, plan_tree, tree_expected_recompute


def random_tree(rng: np.random.Generator, nodes: int, max_edge: int, zero: float = 0.3) -> PrefixTree:
    parent, edge, mass = [-1], [0], [np.zeros(0)]
    for v in range(1, nodes):
        parent.append(int(rng.integers(0, v)))
        length = int(rng.integers(1, max_edge + 1))
        edge.append(length)
        m = rng.random(length)
        m[rng.random(length) < zero] = 0.0
        mass.append(m)
    if sum(float(m.sum()) for m in mass) == 0:
        mass[-1][-1] = 1.0
    return PrefixTree(tuple(parent), tuple(edge), tuple(mass), root_mass=float(rng.random()))


def brute_force(tree: PrefixTree, slots: int, align: int) -> float:
    points = [
        (v, c) for v in range(1, tree.size) for c in range(tree.top[v] + 1, tree.end(v) + 1) if c % align == 0
    ]
    best = tree_expected_recompute(tree, [])
    for k in range(1, min(slots, len(points)) + 1):
        for chosen in itertools.combinations(points, k):
            best = min(best, tree_expected_recompute(tree, list(chosen)))
    return best


def valid(tree: PrefixTree, points: list[tuple[int, int]], slots: int, align: int) -> bool:
    return (
        len(points) <= slots
        and points == sorted(set(points))
        and all(0 < v < tree.size and tree.top[v] < c <= tree.end(v) and c % align == 0 for v, c in points)
    )


def test_tree_dp_matches_brute_force() -> None:
    rng = np.random.default_rng(3)
    for case in range(400):
        tree = random_tree(rng, int(rng.integers(2, 7)), 4)
        slots, align = int(rng.integers(0, 4)), int(rng.choice([1, 1, 2, 3]))
        got = plan_tree(tree, slots, align)
        assert valid(tree, got, slots, align)
        assert math.isclose(
            tree_expected_recompute(tree, got), brute_force(tree, slots, align), rel_tol=1e-9, abs_tol=1e-12
        ), case


def test_independent_baseline_obeys_budget_and_never_beats_tree() -> None:
    rng = np.random.default_rng(4)
    for _ in range(60):
        tree = random_tree(rng, int(rng.integers(2, 25)), 40)
        slots, align = int(rng.integers(0, 10)), int(rng.choice([1, 4]))
        tree_plan, indep = plan_tree(tree, slots, align), plan_independent(tree, slots, align)
        assert valid(tree, tree_plan, slots, align) and valid(tree, indep, slots, align)
        assert tree_expected_recompute(tree, tree_plan) <= tree_expected_recompute(tree, indep) + 1e-12


def test_a_path_is_the_single_prefix_problem() -> None:
    rng = np.random.default_rng(5)
    for _ in range(60):
        n = int(rng.integers(2, 60))
        w = rng.random(n + 1) * (rng.random(n + 1) < 0.6)
        w[n] += 0.1
        cuts = sorted(
            rng.choice(np.arange(1, n), size=min(n - 1, int(rng.integers(0, 5))), replace=False).tolist()
        )
        bounds = [0, *cuts, n]
        k = len(bounds) - 1
        tree = PrefixTree(
            (-1, *range(k)),
            (0, *(bounds[i + 1] - bounds[i] for i in range(k))),
            (np.zeros(0), *(w[bounds[i] + 1 : bounds[i + 1] + 1] for i in range(k))),
            root_mass=float(w[0]),
        )
        slots, align = int(rng.integers(0, 6)), int(rng.integers(1, 4))
        if align > n:
            continue
        line = expected_recompute(w, plan_checkpoints(w, slots, "optimal", align))
        assert math.isclose(
            tree_expected_recompute(tree, plan_tree(tree, slots, align)), line, rel_tol=1e-9, abs_tol=1e-12
        )


def test_shared_stem_beats_independent_entries() -> None:
    # one 64-token system prompt, four 64-token branches; requests end at the prompt or a branch end
    mass_stem = np.zeros(64)
    mass_stem[-1] = 4.0
    leaf = np.zeros(64)
    leaf[-1] = 1.0
    tree = PrefixTree(
        (-1, 0, 1, 1, 1, 1), (0, 64, 64, 64, 64, 64), (np.zeros(0), mass_stem, leaf, leaf, leaf, leaf)
    )
    shared = plan_tree(tree, 5)
    assert shared == [(1, 64), (2, 128), (3, 128), (4, 128), (5, 128)]
    assert tree_expected_recompute(tree, shared) == 0.0
    indep = plan_independent(tree, 5)  # every entry re-stores the stem
    assert tree_expected_recompute(tree, indep) > 0.0


def test_tree_expected_recompute_by_hand() -> None:
    # root -> a (3 tokens) -> b (2 tokens); requests end at depth 2 (a) and at depth 5 (b)
    tree = PrefixTree((-1, 0, 1), (0, 3, 2), (np.zeros(0), np.array([0.0, 1.0, 0.0]), np.array([0.0, 1.0])))
    assert tree_expected_recompute(tree, []) == pytest.approx((2 + 5) / 2)
    assert tree_expected_recompute(tree, [(1, 3)]) == pytest.approx((2 + 2) / 2)
    assert tree_expected_recompute(tree, [(1, 2), (2, 4)]) == pytest.approx((0 + 1) / 2)
    with pytest.raises(ValueError, match=r"checkpoints: \(1, 4\) is not a point on an edge"):
        tree_expected_recompute(tree, [(1, 4)])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (((0,), (0,), (np.zeros(0),)), "parent: node 0 must be the root"),
        (((-1, 0), (0,), (np.zeros(0),)), "edge_len/mass: need one entry per node (2)"),
        (((-1, 1), (0, 2), (np.zeros(0), np.ones(2))), "parent[1]: must be a node id in 0..0"),
        (((-1, 0), (0, 0), (np.zeros(0), np.ones(0))), "edge_len[1]: a non-root edge holds >= 1 token"),
        (((-1, 0), (1, 2), (np.zeros(1), np.ones(2))), "edge_len[0]: the root has no edge"),
        (((-1, 0), (0, 2), (np.zeros(0), np.ones(3))), "mass[1]: expected shape (2,)"),
        (((-1, 0), (0, 2), (np.zeros(0), -np.ones(2))), "mass[1]: weights must be finite and >= 0"),
        (((-1, 0), (0, 2), (np.zeros(0), np.zeros(2))), "mass: the tree carries no request mass"),
    ],
)
def test_bad_tree(
    args: tuple[tuple[int, ...], tuple[int, ...], tuple[np.ndarray, ...]], message: str
) -> None:
    with pytest.raises(ValueError) as err:
        PrefixTree(*args)
    assert message in str(err.value)


def test_bad_budget() -> None:
    tree = PrefixTree((-1, 0), (0, 2), (np.zeros(0), np.ones(2)))
    with pytest.raises(ValueError, match="slots: must be an int >= 0"):
        plan_tree(tree, -1)
    with pytest.raises(ValueError, match="align: must be an int >= 1"):
        plan_independent(tree, 1, align=0)
