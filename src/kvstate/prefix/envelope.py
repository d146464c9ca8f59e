"""Upper-envelope queries — the convex-hull-trick engine behind the exact placement DP of sparse prefix
caching ("Sparse Prefix Caching for Hybrid and Recurrent LLM Serving", Theorem 2), used by
:mod:`kvstate.prefix.placement`.

``tangent_points(dx, y, q)``: for points ``(x_i, y_i)`` with ``x`` strictly increasing (given by its
gaps ``dx``) and query slopes ``q_j``, the index ``i`` maximising ``y_i - q_j x_i``. The maximiser is the
upper hull's vertex where the hull's edge slopes pass ``q_j``. Those edge slopes are the slopes of the
least concave majorant, i.e. the antitonic regression of the chord slopes ``(y_{i+1} - y_i) / dx_i``
weighted by ``dx_i``: one pool-adjacent-violators pass (SciPy's C kernel, ``O(n)``) gives every chord
the slope of the hull edge above it, non-increasing, and the tangent vertex of ``q_j`` is the number of
chords whose hull slope exceeds ``q_j`` (one binary search per query). No hull is built: two C calls and
a few whole-array steps, which matters when a DP calls this once per layer on a few thousand points.

Exact up to float rounding of the pooled slopes: where two candidates tie within rounding either may be
returned (the values they reach differ by rounding only). Exact ties go to the smaller index.
Ignores: lower envelopes and unsorted ``x`` (callers pass sorted grids).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
from scipy.optimize import isotonic_regression

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.intp]

try:  # SciPy's C kernel behind isotonic_regression, without its per-call validation and copies
    from scipy.optimize._pava_pybind import pava as _pava
except ImportError:  # pragma: no cover - another SciPy layout: the public function gives the same fit
    _pava = None


def tangent_points(dx: FloatArray, y: FloatArray, q: FloatArray) -> IntArray:
    """For each query ``q[j]``, the index ``i`` of the point maximising ``y[i] - q[j] * x[i]``.

    ``dx`` (length ``n - 1``, all > 0) are the gaps of the strictly increasing ``x``; ``y`` has length
    ``n``; ``q`` any length and order. Ties go to the smaller index (see the module docstring).
    """
    neg = (y[:-1] - y[1:]) / dx  # minus the chord slopes
    hull = _increasing_fit(neg, dx)  # minus each chord's hull-edge slope, non-decreasing
    found: IntArray = np.searchsorted(hull, -q, side="left")  # chords whose hull slope > q
    return found


def _increasing_fit(values: FloatArray, weights: FloatArray) -> FloatArray:
    """Weighted isotonic (non-decreasing) regression of ``values`` by pool-adjacent-violators.

    ``values`` is overwritten with the fit and returned; ``weights`` is left as it was.
    """
    if _pava is None:  # another SciPy layout (the tests take this path too)
        fit: FloatArray = isotonic_regression(values, weights=weights).x
        values[:] = fit
        return values
    blocks = np.full(values.size + 1, -1, dtype=np.intp)  # as SciPy's own wrapper passes it
    _pava(values, weights.copy(), blocks)  # in place; the kernel also overwrites its weights
    return values
