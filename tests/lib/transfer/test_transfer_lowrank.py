"""Reduced-rank regression and PATCH-layer choice against brute force (pure NumPy)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstate.transfer.lowrank import fit_low_rank, relative_error, select_patch_layers


def _data(seed: int = 0, n: int = 400, d_in: int = 12, d_out: int = 10) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d_in)) @ rng.normal(size=(d_in, d_in))
    y = x @ rng.normal(size=(d_in, d_out)) + 0.3 * rng.normal(size=(n, d_out)) + 2.0
    return x.astype(np.float32), y.astype(np.float32)


def test_full_rank_is_least_squares_and_identity_for_equal_states() -> None:
    x, y = _data()
    m = fit_low_rank(x, y, 10, ridge=0.0)
    xa = np.c_[x, np.ones(len(x))]
    ref = xa @ np.linalg.lstsq(xa, y, rcond=None)[0]
    assert np.allclose(m.decode(m.encode(x)), ref, atol=1e-3)
    same = fit_low_rank(x, x, 12)
    assert np.allclose(same.decode(same.encode(x)), x, atol=1e-3 * np.abs(x).max())


def test_rank_r_beats_other_rank_r_maps_and_error_falls_with_rank() -> None:
    x, y = _data(1)
    errs = [relative_error(fit_low_rank(x, y, r).decode(fit_low_rank(x, y, r).encode(x)), y) for r in range(1, 11)]
    assert all(a >= b - 1e-6 for a, b in itertools.pairwise(errs))
    rng = np.random.default_rng(2)
    xc, yc = x - x.mean(0), y - y.mean(0)
    w = np.linalg.lstsq(xc, yc, rcond=None)[0]
    u, s, vt = np.linalg.svd(w, full_matrices=False)  # truncating W itself: another rank-3 map
    other = xc @ (u[:, :3] * s[:3]) @ vt[:3] + y.mean(0)
    rand = xc @ rng.normal(size=(12, 3)) @ np.linalg.lstsq(xc @ rng.normal(size=(12, 3)), yc, rcond=None)[0] + y.mean(0)
    best = fit_low_rank(x, y, 3)
    assert relative_error(best.decode(best.encode(x)), y) <= min(relative_error(other, y), relative_error(rand, y)) + 1e-6


def test_bad_shapes_and_ranks_raise() -> None:
    x, y = _data()
    with pytest.raises(ValueError, match="rank"):
        fit_low_rank(x, y, 11)
    with pytest.raises(ValueError, match="same N"):
        fit_low_rank(x, y[:5], 2)
    with pytest.raises(ValueError, match="budget"):
        select_patch_layers([1.0, 2.0], 3)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 20), min_size=1, max_size=7), st.sampled_from([0.0, 0.25, 0.5, 0.8]))
def test_auto_patch_choice_is_the_smallest_set_leaving_at_most_keep(ints: list[int], keep: float) -> None:
    impact = [float(v) for v in ints]  # exact sums: the brute force and the greedy see the same numbers
    got = select_patch_layers(impact, None, keep)
    total = sum(impact)
    assert sum(impact) - sum(impact[i] for i in got) <= keep * total
    smallest = min(len(s) for k in range(len(impact) + 1) for s in itertools.combinations(range(len(impact)), k)
                   if total - sum(impact[i] for i in s) <= keep * total)
    assert len(got) == smallest and got == sorted(got)
    assert select_patch_layers(impact, len(impact)) == list(range(len(impact)))


def test_pca_map_is_the_producer_subspace() -> None:
    from kvstate.transfer.lowrank import fit_pca, truncate

    x, _ = _data(3)
    full = fit_pca(x, 12)
    assert np.allclose(full.decode(full.encode(x)), x, atol=1e-3 * np.abs(x).max())
    errs = [relative_error(truncate(full, r).decode(truncate(full, r).encode(x)), x) for r in (2, 6, 12)]
    svals = np.linalg.svd(x - x.mean(0), compute_uv=False)
    expect = [np.sqrt((svals[r:] ** 2).sum()) / np.linalg.norm(x) for r in (2, 6, 12)]  # Eckart-Young
    assert np.allclose(errs, expect, atol=1e-4)


def _rotation(d: int, seed: int) -> np.ndarray:
    return np.linalg.qr(np.random.default_rng(seed).normal(size=(d, d)))[0]


def test_joint_map_recovers_a_similarity_relation_exactly_at_full_rank_and_on_its_subspace() -> None:
    from kvstate.transfer.lowrank import fit_joint, truncate

    x, _ = _data(4)
    y = 1.7 * x @ _rotation(12, 5) - 3.0  # a known linear relation: scaled rotation plus offset
    full = fit_joint(x, y, 12)
    assert relative_error(full.decode(full.encode(x)), y) < 1e-5
    assert relative_error(full.decode(full.encode(x[:7] * 2.0)), 1.7 * (x[:7] * 2.0) @ _rotation(12, 5) - 3.0) < 1e-5
    rng = np.random.default_rng(6)  # states on a 5-dim subspace: rank 5 is already exact, rank 4 is not
    x5 = (rng.normal(size=(300, 5)) @ rng.normal(size=(5, 12))).astype(np.float32)
    y5 = 0.5 * x5 @ _rotation(12, 7)
    assert relative_error(fit_joint(x5, y5, 5).decode(fit_joint(x5, y5, 5).encode(x5)), y5) < 1e-5
    assert relative_error(truncate(fit_joint(x5, y5, 12), 4).decode(fit_joint(x5, y5, 4).encode(x5)), y5) > 1e-2


def test_joint_map_keeps_token_geometry_where_regression_distorts_it() -> None:
    """With noise, least squares shrinks the directions the noise hides; the joint map's decoder is a scaled
    orthogonal map, so the code's inner products between tokens reach the consumer up to one scale."""
    from kvstate.transfer.lowrank import fit_joint

    rng = np.random.default_rng(8)
    x = rng.normal(size=(2000, 8)) * np.array([4, 3, 2, 1, 1, 0.5, 0.5, 0.3])
    y = x @ _rotation(8, 9) + 0.8 * rng.normal(size=x.shape)
    joint, reg = fit_joint(x, y, 8), fit_low_rank(x, y, 8)
    xc = x - x.mean(0)
    for m, keeps in ((joint, True), (reg, False)):
        out = m.decode(m.encode(x)) - m.mean_out
        gram, ref = out[:50] @ out[:50].T, xc[:50] @ xc[:50].T
        s = np.trace(gram) / np.trace(ref)
        assert (relative_error(gram, s * ref) < 1e-4) == keeps
    with pytest.raises(ValueError, match="rank"):
        fit_joint(x, y, 9)
