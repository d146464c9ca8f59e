"""Checkpoint placement (sparse prefix caching): the exact DP against a brute-force oracle, baselines against their
definitions, the envelope engine against a brute-force maximum, and bad input."""

from __future__ import annotations

import math
from functools import cache
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstate.prefix import envelope
from kvstate.prefix.envelope import tangent_points
from kvstate.prefix.placement import (
    METHODS,
    expected_recompute,
    plan_checkpoints,
    plan_quadratic_dp,
)


@cache
def _subsets(g: int) -> tuple[np.ndarray, np.ndarray]:
    """Membership matrix of all subsets of g grid points, (2^g, g), and their sizes."""
    masks = np.arange(1 << g)
    member = (masks[:, None] >> np.arange(g)[None, :]) & 1
    return member, member.sum(axis=1)


def oracle(w: np.ndarray, slots: int, align: int) -> float:
    """Minimum expected recompute over every grid subset of size <= slots (all subsets at once)."""
    n = w.size - 1
    grid = np.arange(align, n + 1, align)
    member, size = _subsets(grid.size)
    deepest = np.maximum.accumulate(member * grid, axis=1)  # deepest chosen point among the first k
    served = np.concatenate((np.zeros((member.shape[0], 1), dtype=np.int64), deepest), axis=1)
    served = served[:, np.minimum(np.arange(n + 1) // align, grid.size)]  # l(t) for every subset
    cost = (np.arange(n + 1) - served) @ w / w.sum()
    return float(cost[size <= slots].min())


def random_weights(rng: np.random.Generator, n: int, shape: str) -> np.ndarray:
    t = np.arange(n + 1)
    if shape == "uniform":
        w = np.ones(n + 1)
    elif shape == "spiky":
        w = np.where(rng.random(n + 1) < 0.2, rng.random(n + 1) * 50, rng.random(n + 1) * 0.01)
    elif shape == "bimodal":
        c1, c2 = rng.random(2) * n
        s1, s2 = rng.random(2) * n / 6 + 0.5
        w = np.exp(-0.5 * ((t - c1) / s1) ** 2) + rng.random() * np.exp(-0.5 * ((t - c2) / s2) ** 2)
    elif shape == "zero_heavy":
        w = np.where(rng.random(n + 1) < 0.7, 0.0, rng.random(n + 1))
    else:  # integer counts, ties galore
        w = rng.integers(0, 4, n + 1).astype(np.float64)
    if w.sum() <= 0:
        w[-1] = 1.0
    return w


SHAPES = ["uniform", "spiky", "bimodal", "zero_heavy", "counts"]


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


@pytest.mark.parametrize("shape", SHAPES)
def test_optimal_matches_brute_force(shape: str) -> None:
    rng = np.random.default_rng(abs(hash(shape)) % 2**32)
    for case in range(500):
        n = int(rng.integers(1, 13))
        align = int(rng.integers(1, n + 1)) if case % 3 == 0 else 1
        slots = int(rng.integers(0, 6))
        w = random_weights(rng, n, shape)
        got = plan_checkpoints(w, slots, "optimal", align)
        assert len(got) <= slots and got == sorted(set(got))
        assert all(1 <= c <= n and c % align == 0 for c in got)
        assert close(expected_recompute(w, got), oracle(w, slots, align)), (case, n, slots, align, w, got)


def test_quadratic_reference_matches_brute_force() -> None:
    rng = np.random.default_rng(5)
    for case in range(300):
        n = int(rng.integers(1, 11))
        align = int(rng.integers(1, n + 1)) if case % 2 else 1
        slots = int(rng.integers(0, 5))
        w = random_weights(rng, n, SHAPES[case % len(SHAPES)])
        got = plan_quadratic_dp(w, slots, align)
        assert close(expected_recompute(w, got), oracle(w, slots, align))


@pytest.mark.parametrize("shape", ["spiky", "bimodal", "zero_heavy", "counts"])
def test_optimal_matches_quadratic_dp_at_moderate_n(shape: str) -> None:
    # long concave runs and far spikes exercise the hull's bridge step, which tiny N never reaches
    rng = np.random.default_rng(11)
    for _ in range(4):
        n, slots, align = int(rng.integers(200, 500)), int(rng.integers(1, 10)), int(rng.choice([1, 2, 5]))
        w = random_weights(rng, n, shape)
        w[-1] += rng.random() * w.sum()  # a full-prefix spike, as for repeated documents
        a = expected_recompute(w, plan_checkpoints(w, slots, "optimal", align))
        assert close(a, expected_recompute(w, plan_quadratic_dp(w, slots, align)))


def test_optimal_at_larger_n_with_drifting_tail() -> None:
    n, slots = 1500, 8
    t = np.arange(n + 1)
    w = np.exp(-t / 40.0) + 1e-9 * np.exp(-(((t - 900) / 30.0) ** 2)) + np.where(t == n, 3.0, 0.0)
    a = expected_recompute(w, plan_checkpoints(w, slots))
    assert close(a, expected_recompute(w, plan_quadratic_dp(w, slots)))


@pytest.mark.parametrize("align", [1, 2, 3, 7])
def test_balanced_is_optimal_for_uniform_weights(align: int) -> None:
    for n in range(max(align, 1), 40):
        w = np.ones(n + 1)
        for slots in range(0, 7):
            got = plan_checkpoints(w, slots, "balanced", align)
            assert close(
                expected_recompute(w, got),
                expected_recompute(w, plan_checkpoints(w, slots, "optimal", align)),
            )
            if got:  # Theorem 1's shape: all M+1 stretches within one grid step of each other
                stretch = np.diff([0, *got, n + 1])
                assert stretch.max() - stretch.min() <= align, (n, slots, got)


@pytest.mark.parametrize("method", METHODS)
def test_every_method_obeys_the_contract_and_never_beats_optimal(method: str) -> None:
    rng = np.random.default_rng(sum(map(ord, method)))
    for case in range(150):
        n = int(rng.integers(1, 300))
        align = int(rng.integers(1, min(n, 16) + 1))
        slots = int(rng.integers(0, 12))
        w = random_weights(rng, n, SHAPES[case % len(SHAPES)])
        got = plan_checkpoints(w, slots, method, align, block_size=int(rng.integers(1, 100)))
        assert got == sorted(set(got)) and len(got) <= slots
        assert all(isinstance(c, int) and 1 <= c <= n and c % align == 0 for c in got)
        best = expected_recompute(w, plan_checkpoints(w, slots, "optimal", align))
        assert expected_recompute(w, got) >= best - 1e-9 * max(best, 1.0)


def test_baselines_follow_their_definitions() -> None:
    w = np.ones(101)
    assert plan_checkpoints(w, 2, "block", block_size=30) == [30, 60]
    assert plan_checkpoints(w, 9, "block", align=8, block_size=30) == [32, 64, 96]  # 30 -> 32 on the grid
    assert plan_checkpoints(w, 3, "log") == [16, 32, 64]
    assert plan_checkpoints(w, 3, "log", align=4) == [16, 32, 64]
    assert plan_checkpoints(w, 4, "log", align=3) == [12, 24, 48, 96]  # align * 2^k
    assert plan_checkpoints(w, 20, "sqrt") == [10, 20, 30, 40, 50, 60, 70, 80, 90, 100]
    assert plan_checkpoints(np.ones(102), 3, "sqrt", align=4) == [12, 24, 36]  # ceil(sqrt 101)=11 -> 12
    spikes = np.zeros(101)
    spikes[[7, 42, 43, 90]] = [5.0, 1.0, 2.0, 2.5]
    assert plan_checkpoints(spikes, 2, "junction") == [7, 90]
    assert plan_checkpoints(spikes, 2, "junction", align=4) == [4, 40]  # cell [40, 44) holds 3.0
    assert plan_checkpoints(w, 0, "balanced") == []


def test_optimal_keeps_only_useful_checkpoints() -> None:
    w = np.array([0.0, 1.0, 0.0, 0.0, 0.0])
    assert plan_checkpoints(w, 3) == [1]  # no mass deeper than 1: more checkpoints save nothing
    assert plan_checkpoints(np.array([1.0, 0, 0, 0]), 2) == []
    assert plan_checkpoints(np.ones(6), 100) == [1, 2, 3, 4, 5]


def test_expected_recompute_by_hand() -> None:
    w = np.array([1.0, 1.0, 1.0, 1.0, 1.0])  # depths 0..4
    assert expected_recompute(w, []) == pytest.approx((0 + 1 + 2 + 3 + 4) / 5)
    assert expected_recompute(w, [2]) == pytest.approx((0 + 1 + 0 + 1 + 2) / 5)
    assert expected_recompute(w * 7, [4, 2, 2]) == pytest.approx((0 + 1 + 0 + 1 + 0) / 5)


@settings(max_examples=150, deadline=None)
@given(
    w=st.lists(st.one_of(st.just(0.0), st.floats(1e-6, 1e6)), min_size=2, max_size=60),
    slots=st.integers(0, 8),
    align=st.integers(1, 5),
    scale=st.floats(1e-3, 1e3),
)
def test_properties(w: list[float], slots: int, align: int, scale: float) -> None:
    arr = np.asarray(w)
    n = arr.size - 1
    if arr.sum() <= 0 or align > n:
        return
    got = plan_checkpoints(arr, slots, "optimal", align)
    cost = expected_recompute(arr, got)
    assert got == sorted(set(got)) and len(got) <= slots and all(c % align == 0 and 1 <= c <= n for c in got)
    assert 0.0 <= cost <= expected_recompute(arr, [])
    # one more slot never hurts; rescaling the weights changes nothing
    assert expected_recompute(arr, plan_checkpoints(arr, slots + 1, "optimal", align)) <= cost + 1e-9 * max(
        cost, 1
    )
    assert math.isclose(
        expected_recompute(arr, plan_checkpoints(arr * scale, slots, "optimal", align)),
        cost,
        rel_tol=1e-9,
        abs_tol=1e-9,
    )
    for method in METHODS:
        assert expected_recompute(arr, plan_checkpoints(arr, slots, method, align)) >= cost - 1e-9 * max(
            cost, 1
        )


def _points(rng: np.random.Generator, n: int, kind: int) -> tuple[np.ndarray, np.ndarray]:
    x = np.sort(rng.choice(10_000, n, replace=False)).astype(np.float64)
    if kind == 0:
        y = rng.normal(size=n).cumsum()
    elif kind == 1:  # concave run then a far high point
        y = -((x - 5000.0) ** 2) / 1e4
        y[-1] += rng.random() * 5e3
    elif kind == 2:  # collinear stretches and ties
        y = np.round(rng.normal(size=n))
    elif kind == 3:  # nearly collinear: steps of one over a line
        y = 3.0 * x + rng.integers(0, 2, n)
    else:
        y = rng.random(n)
    return x, y


@settings(max_examples=400, deadline=None)
@given(st.integers(2, 300), st.integers(0, 2**32 - 1), st.integers(0, 4), st.booleans())
def test_tangent_points_reach_the_upper_envelope(n: int, seed: int, kind: int, public: bool) -> None:
    """Every query's point reaches max_i y_i - q x_i (brute force over all points), for queries at
    the chord slopes (ties), between and beyond them, in any order; also through SciPy's public
    isotonic_regression (the path taken when its C kernel cannot be imported)."""
    rng = np.random.default_rng(seed)
    x, y = _points(rng, n, kind)
    chords = np.diff(y) / np.diff(x)
    q = np.concatenate((chords, rng.uniform(chords.min() - 1, chords.max() + 1, n)))
    rng.shuffle(q)
    with mock.patch.object(envelope, "_pava", None if public else envelope._pava):
        got = tangent_points(np.diff(x), y, q)
    values = y[None, :] - q[:, None] * x[None, :]
    reached = values[np.arange(q.size), got]
    tol = 1e-9 * (np.abs(y).max() + np.abs(q).max() * x.max() + 1.0)
    assert got.shape == q.shape and np.all((got >= 0) & (got < n))
    assert np.all(reached >= values.max(axis=1) - tol)


def test_tangent_points_break_exact_ties_towards_the_smaller_index() -> None:
    x = np.arange(6, dtype=np.float64)
    y = np.array([0.0, 5.0, 9.0, 12.0, 14.0, 15.0])  # concave, chord slopes 5, 4, 3, 2, 1
    q = np.array([6.0, 5.0, 4.5, 4.0, 1.0, 0.5, 3.0])
    assert tangent_points(np.diff(x), y, q).tolist() == [0, 0, 1, 1, 4, 5, 2]


BAD = [
    (dict(weights=[]), "weights: expected a 1-D array of length N+1 >= 2"),
    (dict(weights=[1.0]), "weights: expected a 1-D array"),
    (dict(weights=[[1.0, 2.0]]), "weights: expected a 1-D array"),
    (dict(weights=[1.0, -1.0]), "weights: contains negative entries"),
    (dict(weights=[1.0, float("nan")]), "weights: contains NaN or inf"),
    (dict(weights=[1.0, float("inf")]), "weights: contains NaN or inf"),
    (dict(weights=["a", "b"]), "weights: cannot be read as numbers"),
    (dict(weights=[0.0, 0.0, 0.0]), "weights: all zero"),
    (dict(slots=-1), "slots: must be an int >= 0"),
    (dict(slots=2.5), "slots: must be an int >= 0"),
    (dict(align=0), "align: must be an int in 1..N=4"),
    (dict(align=5), "align: must be an int in 1..N=4"),
    (
        dict(method="dense"),
        "method: unknown 'dense'; choose one of optimal, balanced, block, log, sqrt, junction",
    ),
    (dict(method="block", block_size=0), "block_size: must be an int >= 1"),
]


@pytest.mark.parametrize(("kwargs", "message"), BAD)
def test_bad_input_names_the_argument_and_the_fix(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = dict(weights=np.ones(5), slots=2, method="optimal", align=1)
    args.update(kwargs)
    block = args.pop("block_size", 64)
    with pytest.raises(ValueError) as err:
        plan_checkpoints(args["weights"], args["slots"], args["method"], args["align"], block_size=block)  # type: ignore[arg-type]
    assert message in str(err.value)


def test_bad_positions_and_reference_inputs() -> None:
    with pytest.raises(ValueError, match=r"positions: checkpoint positions must lie in 1..N=4"):
        expected_recompute(np.ones(5), [0, 2])
    with pytest.raises(ValueError, match=r"positions: checkpoint positions must lie in 1..N=4"):
        expected_recompute(np.ones(5), [5])
    with pytest.raises(ValueError, match="positions: expected integer checkpoint positions"):
        expected_recompute(np.ones(5), [1.5])
    with pytest.raises(ValueError, match="weights: all zero"):
        expected_recompute(np.zeros(5), [1])
    with pytest.raises(ValueError, match=r"align: must be an int in 1\.\.N=4"):
        plan_quadratic_dp(np.ones(5), 1, align=9)
