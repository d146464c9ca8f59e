"""Overlap histogram (decay, smoothing, bins), total variation and the Theorem-3 bound (sparse prefix caching)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvstate.prefix.histogram import OverlapHistogram, regret_bound, total_variation
from kvstate.prefix.placement import expected_recompute, plan_checkpoints


def test_decay_multiplies_existing_mass_per_observation() -> None:
    h = OverlapHistogram(5, gamma=0.5)
    h.record(2)
    h.record(3)
    h.record(3)
    np.testing.assert_allclose(h.weights(), [0, 0, 0.25, 1.5, 0, 0])
    assert h.count == 3 and h.total_mass == pytest.approx(1.75)
    assert h.effective_count == pytest.approx(1.75**2 / (0.25**2 + 0.5**2 + 1))


def test_record_many_equals_sequential_records() -> None:
    rng = np.random.default_rng(0)
    depths = rng.integers(0, 41, 300)
    a, b = OverlapHistogram(40, gamma=0.97, bin_width=3), OverlapHistogram(40, gamma=0.97, bin_width=3)
    for d in depths:
        a.record(int(d))
    b.record_many(depths[:100])
    b.record_many(depths[100:])
    np.testing.assert_allclose(a.weights(), b.weights(), rtol=1e-12)
    assert a.effective_count == pytest.approx(b.effective_count)


def test_effective_count_limits() -> None:
    h = OverlapHistogram(3)
    h.record_many(np.zeros(10, dtype=int))
    assert h.effective_count == pytest.approx(10)
    g = OverlapHistogram(3, gamma=0.9)
    g.record_many(np.zeros(2000, dtype=int))
    assert g.effective_count == pytest.approx((1 + 0.9) / (1 - 0.9))


def test_laplace_smoothing_and_bins_at_their_first_depth() -> None:
    h = OverlapHistogram(9, alpha=0.5, bin_width=4)  # bins [0,4) [4,8) [8,9]
    assert h.weights().tolist() == [0.5, 0, 0, 0, 0.5, 0, 0, 0, 0.5, 0]
    h.record(6)
    h.record(7)
    h.record(9)
    assert h.weights().tolist() == [0.5, 0, 0, 0, 2.5, 0, 0, 0, 1.5, 0]
    np.testing.assert_allclose(h.probabilities().sum(), 1.0)
    # a checkpoint planned from bin starts is reachable by every request of the bin
    assert plan_checkpoints(h.weights(), 1) == [4]


def test_probabilities_need_mass() -> None:
    h = OverlapHistogram(4)
    assert h.weights().sum() == 0
    with pytest.raises(ValueError, match="histogram: no observations and alpha == 0"):
        h.probabilities()


def test_extended_keeps_mass_and_grows_range() -> None:
    h = OverlapHistogram(3, gamma=0.9, alpha=0.1)
    h.record(3)
    g = h.extended(6)
    assert g.n == 6 and g.count == 1 and g.gamma == 0.9 and g.alpha == 0.1
    np.testing.assert_allclose(g.weights(), [0.1, 0.1, 0.1, 1.1, 0.1, 0.1, 0.1])
    g.record(6)
    assert h.weights().size == 4  # the original is untouched
    with pytest.raises(ValueError, match="n: extended\\(\\) only grows"):
        g.extended(2)


def test_total_variation_by_hand() -> None:
    assert total_variation([1, 0], [0, 1]) == 1.0
    assert total_variation([2, 2], [1, 1]) == 0.0
    assert total_variation([1, 0], [1, 1]) == 0.5
    assert total_variation([1, 1], [1, 1, 2]) == pytest.approx(0.5)  # depth 2 has no mass in p
    h = OverlapHistogram(1)
    h.record(0)
    assert h.total_variation([0, 1]) == 1.0
    other = OverlapHistogram(1)
    other.record(0)
    other.record(1)
    assert h.total_variation(other) == pytest.approx(0.5)


def test_drift_stale_mass_decays_geometrically() -> None:
    # Theorem 4: after a switch, the old distribution keeps weight gamma^k of the total it had
    gamma, old, new = 0.95, 200, 30
    h = OverlapHistogram(10, gamma=gamma)
    h.record_many(np.full(old, 3))
    h.record_many(np.full(new, 9))
    stale = gamma**new * (1 - gamma**old) / (1 - gamma ** (old + new))
    target = np.zeros(11)
    target[9] = 1
    assert h.total_variation(target) == pytest.approx(stale)


def test_regret_bound_by_hand() -> None:
    n = 8
    p, q = np.zeros(n + 1), np.zeros(n + 1)
    p[n], q[1] = 1.0, 1.0  # truth: full overlap; plan made for overlap 1
    c_q, c_p = plan_checkpoints(q, 1), plan_checkpoints(p, 1)
    assert (c_q, c_p) == ([1], [n])
    regret = expected_recompute(p, c_q) - expected_recompute(p, c_p)
    assert regret == n - 1 <= regret_bound(q, p) == 2 * n * 1.0


def test_lemma1_and_theorem3_hold_on_random_distributions() -> None:
    rng = np.random.default_rng(7)
    for case in range(400):
        n = int(rng.integers(1, 60))
        slots = int(rng.integers(0, 6))
        p = rng.random(n + 1) ** rng.uniform(1, 8)
        q = p * rng.uniform(0, 2, n + 1) if case % 2 else rng.random(n + 1)  # near and far estimates
        q[rng.integers(0, n + 1)] += 1e-3
        tv = total_variation(p, q)
        c_q, c_p = plan_checkpoints(q, slots), plan_checkpoints(p, slots)
        regret = expected_recompute(p, c_q) - expected_recompute(p, c_p)
        assert -1e-9 <= regret <= regret_bound(q, p) + 1e-9
        any_c = sorted(set(rng.integers(1, n + 1, slots).tolist()))
        assert abs(expected_recompute(p, any_c) - expected_recompute(q, any_c)) <= n * tv + 1e-9  # Lemma 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(n=-1), "n: the deepest overlap depth must be an int >= 0"),
        (dict(n=3, gamma=0.0), "gamma: decay must be in (0, 1]"),
        (dict(n=3, gamma=1.5), "gamma: decay must be in (0, 1]"),
        (dict(n=3, alpha=-1.0), "alpha: Laplace smoothing must be a finite float >= 0"),
        (dict(n=3, alpha=math.inf), "alpha: Laplace smoothing must be a finite float >= 0"),
        (dict(n=3, bin_width=0), "bin_width: must be an int >= 1"),
    ],
)
def test_bad_config(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError) as err:
        OverlapHistogram(**kwargs)  # type: ignore[arg-type]
    assert message in str(err.value)


def test_bad_observations_and_distributions() -> None:
    h = OverlapHistogram(4)
    with pytest.raises(ValueError, match=r"depth: overlap depths must lie in 0..n=4"):
        h.record(5)
    with pytest.raises(ValueError, match=r"depth: overlap depths must lie in 0..n=4"):
        h.record(-1)
    with pytest.raises(ValueError, match="depths: expected ints"):
        h.record_many([1.5])
    assert h.count == 0
    with pytest.raises(ValueError, match="p: all weights are zero"):
        total_variation([0, 0], [1, 0])
    with pytest.raises(ValueError, match="q: weights must be finite and >= 0"):
        total_variation([1, 0], [1, -1])
