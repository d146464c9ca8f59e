"""Overlap-depth histogram and the robustness bound of sparse prefix caching (Lemma 1, Theorems 3 and 4).

The placement DP (:mod:`kvstate.prefix.placement`) needs the distribution ``p`` of the depth ``T`` to
which future requests overlap a prefix. It is estimated from observed overlaps:

- ``gamma`` in (0, 1]: exponential decay for drift (Theorem 4) — each new observation first multiplies
  all existing mass by ``gamma``, so an observation ``k`` steps old weighs ``gamma^k``.
- ``alpha >= 0``: Laplace smoothing, ``alpha`` added to every bin so unseen depths keep some mass.
- ``bin_width >= 1``: depths are bucketed into ``[b*w, (b+1)*w)``; ``weights()`` still has length
  ``N+1`` and puts each bin's mass on the bin's *first* depth. That is the conservative choice for
  recompute: a checkpoint planned at a bin start is reusable by every request of the bin (all of them
  overlap at least that deep), and a request at depth ``t`` in bin ``[s, s+w)`` recomputes at most
  ``w - 1`` tokens more than the plan assumed. Spreading the mass (or putting it at the bin end) would
  let the planner put checkpoints deeper than requests actually reach, where they serve nobody.

Robustness (the seed states the results without constants; these are the ones derived here).
``r(t; C) = t - l(t; C)`` lies in ``[0, N]``, and ``sum_t (p_t - q_t) = 0``, so for any schedule ``C``
``|E_p[r(C)] - E_q[r(C)]| <= N * TV(p, q)`` (Lemma 1, with ``TV = 0.5 * ||p - q||_1``). If ``C_q`` is
optimal for ``q`` and ``C_p`` for ``p``::

    E_p[r(C_q)] - E_p[r(C_p)] <= (E_p - E_q)[r(C_q)] + (E_q[r(C_q)] - E_q[r(C_p)]) + (E_q - E_p)[r(C_p)]
                              <= N*TV + 0 + N*TV = 2 * N * TV(p, q)                         (Theorem 3)

With drift, the decayed histogram is simply the ``q`` of Theorem 3 (Theorem 4); ``effective_count``
(Kish's ``(sum w)^2 / sum w^2``, ``(1 + gamma) / (1 - gamma)`` in the limit) says how many
observations it effectively averages.

Ignores: per-entry bookkeeping and re-plan triggers (the store decides when drift warrants a re-plan).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]
MAX_DEPTH = 2**26  # 64M tokens: weights() of a deeper histogram would take over 512 MB


class OverlapHistogram:
    """Exponentially weighted, smoothed histogram of overlap depths ``0..n`` (pure, no torch).

    ``OverlapHistogram(n, gamma=0.98)``; ``record(depth)`` after each request; ``weights()`` feeds
    :func:`kvstate.prefix.placement.plan_checkpoints`.
    """

    def __init__(self, n: int, *, gamma: float = 1.0, alpha: float = 0.0, bin_width: int = 1) -> None:
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 0 <= n <= MAX_DEPTH:
            raise ValueError(
                f"n: the deepest overlap depth must be an int >= 0 and <= {MAX_DEPTH} (the prefix length), got {n!r}"
            )
        if isinstance(gamma, bool) or not (isinstance(gamma, (int, float)) and 0.0 < gamma <= 1.0):
            raise ValueError(
                f"gamma: decay must be in (0, 1] (1 = no decay, 0.98 = ~50-request memory), got {gamma!r}"
            )
        if isinstance(alpha, bool) or not (isinstance(alpha, (int, float)) and np.isfinite(alpha) and alpha >= 0.0):
            raise ValueError(f"alpha: Laplace smoothing must be a finite float >= 0, got {alpha!r}")
        if isinstance(bin_width, bool) or not isinstance(bin_width, (int, np.integer)) or bin_width < 1:
            raise ValueError(
                f"bin_width: must be an int >= 1 (tokens per bin; 1 = exact depths), got {bin_width!r}"
            )
        self._n, self._gamma, self._alpha, self._bin = int(n), float(gamma), float(alpha), int(bin_width)
        self._mass = np.zeros(self._n // self._bin + 1)  # decayed observation mass per bin
        self._total = 0.0  # sum of observation weights gamma^age
        self._sq = 0.0  # sum of squared observation weights (for the effective count)
        self._count = 0

    @property
    def n(self) -> int:
        """Deepest representable overlap depth (the prefix length)."""
        return self._n

    @property
    def gamma(self) -> float:
        return self._gamma

    @property
    def alpha(self) -> float:
        return self._alpha

    @property
    def bin_width(self) -> int:
        return self._bin

    @property
    def count(self) -> int:
        """Observations recorded (undecayed)."""
        return self._count

    @property
    def total_mass(self) -> float:
        """Decayed observation mass ``sum_i gamma^age_i`` (smoothing excluded)."""
        return self._total

    @property
    def effective_count(self) -> float:
        """Kish effective sample size ``(sum w)^2 / sum w^2`` of the decayed observations."""
        return self._total**2 / self._sq if self._sq > 0 else 0.0

    def record(self, depth: int) -> None:
        """Add one observed overlap depth (an int in ``0..n``)."""
        self.record_many(np.asarray([depth]))

    def record_many(self, depths: npt.ArrayLike) -> None:
        """Add observed depths in arrival order; the same result as ``record`` on each in turn."""
        d = np.asarray(depths)
        if d.ndim != 1 or (d.size and not np.issubdtype(d.dtype, np.integer)):
            raise ValueError(f"depths: expected ints (a 1-D sequence of overlap depths), got dtype {d.dtype}")
        if d.size and (d.min() < 0 or d.max() > self._n):
            raise ValueError(
                f"depth: overlap depths must lie in 0..n={self._n}, got {int(d.min())}..{int(d.max())}; "
                f"cap at the prefix length or use extended(new_n) first"
            )
        k = d.size
        if k == 0:
            return
        age_w = self._gamma ** np.arange(k - 1, -1, -1, dtype=np.float64)  # newest weighs 1
        decay = self._gamma**k
        self._mass *= decay
        self._mass += np.bincount(d // self._bin, weights=age_w, minlength=self._mass.size)
        self._total = self._total * decay + float(age_w.sum())
        self._sq = self._sq * decay * decay + float(np.dot(age_w, age_w))
        self._count += k

    def weights(self) -> FloatArray:
        """Unnormalised weights over depths ``0..n`` (length ``n+1``): decayed counts + ``alpha`` per bin,
        each bin's mass at its first depth. All zero before any observation when ``alpha == 0``."""
        w = np.zeros(self._n + 1)
        w[:: self._bin] = self._mass + self._alpha
        return w

    def probabilities(self) -> FloatArray:
        """``weights()`` scaled to sum to 1; ValueError while the histogram has no mass."""
        w = self.weights()
        total = float(w.sum())
        if total <= 0.0:
            raise ValueError(
                "histogram: no observations and alpha == 0, so no distribution yet; record() first or set alpha > 0"
            )
        p: FloatArray = w / total
        return p

    def total_variation(self, other: OverlapHistogram | npt.ArrayLike) -> float:
        """``TV`` between this histogram's distribution and ``other`` (a histogram or weights array)."""
        q = other.weights() if isinstance(other, OverlapHistogram) else other
        return total_variation(self.weights(), q)

    def extended(self, n: int) -> OverlapHistogram:
        """A copy able to record depths up to ``n >= self.n`` (new depths start with no mass)."""
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < self._n:
            raise ValueError(f"n: extended() only grows the depth range; got {n!r} < current n={self._n}")
        h = OverlapHistogram(n, gamma=self._gamma, alpha=self._alpha, bin_width=self._bin)
        h._mass[: self._mass.size] = self._mass
        h._total, h._sq, h._count = self._total, self._sq, self._count
        return h

    def __repr__(self) -> str:
        return (
            f"OverlapHistogram(n={self._n}, gamma={self._gamma}, alpha={self._alpha}, "
            f"bin_width={self._bin}, count={self._count})"
        )


def _distribution(w: npt.ArrayLike, name: str) -> FloatArray:
    try:
        raw = np.asarray(w)
    except ValueError as exc:
        raise ValueError(f"{name}: cannot be read as an array ({exc}); pass a 1-D array of weights") from None
    if raw.dtype.kind not in "biuf":
        raise ValueError(f"{name}: expected real per-depth weights, got dtype {raw.dtype}")
    with np.errstate(over="ignore"):
        a = raw.astype(np.float64)
    if a.ndim != 1 or a.size == 0:
        raise ValueError(f"{name}: expected a non-empty 1-D array of per-depth weights, got shape {a.shape}")
    if not np.all(np.isfinite(a)) or np.any(a < 0):
        raise ValueError(f"{name}: weights must be finite and >= 0")
    peak = float(a.max())
    if peak <= 0:
        raise ValueError(f"{name}: all weights are zero, so it is no distribution; pass some positive mass")
    a = a / peak  # before summing: huge finite weights would overflow the sum
    res: FloatArray = a / float(a.sum())
    return res


def total_variation(p: npt.ArrayLike, q: npt.ArrayLike) -> float:
    """``TV(p, q) = 0.5 * sum_t |p_t - q_t|`` after scaling each to sum 1.

    Arrays of different lengths are compared with zero mass beyond the shorter one's last depth.
    """
    a, b = _distribution(p, "p"), _distribution(q, "q")
    size = max(a.size, b.size)
    a, b = np.pad(a, (0, size - a.size)), np.pad(b, (0, size - b.size))
    return 0.5 * float(np.abs(a - b).sum())


def regret_bound(planned_on: npt.ArrayLike, truth: npt.ArrayLike) -> float:
    """Theorem 3: extra expected recompute (tokens per request) of a schedule optimal for ``planned_on``
    when requests follow ``truth``, over the best schedule for ``truth``: ``2 * N * TV``.

    ``N`` is the deeper of the two arrays' last depth (recompute per request lies in ``[0, N]``).
    """
    n = max(np.asarray(planned_on).size, np.asarray(truth).size) - 1
    return 2.0 * n * total_variation(planned_on, truth)
