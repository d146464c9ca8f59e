"""Joint low-rank maps between two models' states and the choice of PATCH layers (pure NumPy).

The REUSE half of *Semantic Cache Distillation: Efficient State Transfer via Reuse and Selective
Patching* (see ``docs/techniques.md#across-models``): from paired states ``X`` (producer) and ``Y``
(consumer) of the same tokens, a rank-``r`` linear encoder ``E`` (producer side) and decoder ``D``
(consumer side) with ``Y ≈ (X - μx) E D + μy``.

:func:`fit_joint` (the default) is a joint decomposition that keeps the geometry of the states: the
code is the producer's top-``r`` principal coordinates, and the consumer's decoder is the scaled
orthogonal map (orthogonal Procrustes) that best carries that code onto the consumer's states. Inner
products between tokens survive up to one scale, so the ranking of keys under a query is kept. At full
rank it recovers any similarity relation ``Y = s X R + b`` (``R`` orthogonal) exactly. Measured on the
committed pair (see the docs): the reduced-rank regression :func:`fit_low_rank` — least squares, free
to stretch and shrink directions — halves the average key error yet flattens the retrieval head's
attention on the asked needle, and multi-key retrieval collapses; the orthogonal decoder keeps it.

:func:`fit_low_rank` (reduced-rank regression, the ``regress`` ablation) and :func:`fit_pca` (the
producer's own principal subspace decoded back into the producer's space: no cross-model map, the
``pca`` ablation) remain. Code channels are ordered by the producer's variance, so the first ``r``
channels of a map are a rank-``r`` map (:func:`truncate`; for :func:`fit_joint` its decoder rows are
the larger fit's, not a refit). Ignored: weighting tokens, non-linear encoders (the PATCH aligner is
the non-linear part).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

F32 = npt.NDArray[np.float32]


@dataclass(frozen=True)
class LowRankMap:
    """``y ≈ ((x - mean_in) @ encoder) @ decoder + mean_out``; ``(x - mean_in) @ encoder`` is the code."""

    encoder: F32  # (d_in, r)
    decoder: F32  # (r, d_out)
    mean_in: F32  # (d_in,)
    mean_out: F32  # (d_out,)

    @property
    def rank(self) -> int:
        return int(self.encoder.shape[1])

    def encode(self, x: F32) -> F32:
        return ((x - self.mean_in) @ self.encoder).astype(np.float32)

    def decode(self, z: F32) -> F32:
        return (z @ self.decoder + self.mean_out).astype(np.float32)


def fit_low_rank(x: npt.ArrayLike, y: npt.ArrayLike, rank: int, ridge: float = 1e-6) -> LowRankMap:
    """Reduced-rank regression of ``y`` (N, d_out) on ``x`` (N, d_in) at ``rank`` (<= min(d_in, d_out)).

    ``ridge`` is relative to the mean eigenvalue of ``x``'s covariance (keeps rank-deficient inputs solvable).
    """
    xa = np.asarray(x, dtype=np.float64)
    ya = np.asarray(y, dtype=np.float64)
    if xa.ndim != 2 or ya.ndim != 2 or xa.shape[0] != ya.shape[0]:
        raise ValueError(f"fit_low_rank: x {xa.shape} and y {ya.shape} must be (N, d) arrays with the same N")
    if xa.shape[0] < 2:
        raise ValueError(f"fit_low_rank: need at least 2 paired rows, got {xa.shape[0]}")
    if not 1 <= rank <= min(xa.shape[1], ya.shape[1]):
        raise ValueError(f"fit_low_rank: rank={rank} must be in [1, {min(xa.shape[1], ya.shape[1])}] "
                         "(the smaller state width)")
    if not ridge >= 0:
        raise ValueError(f"fit_low_rank: ridge={ridge} must be >= 0")
    mx, my = xa.mean(0), ya.mean(0)
    xc, yc = xa - mx, ya - my
    cov = xc.T @ xc
    lam = ridge * max(float(np.trace(cov)) / cov.shape[0], 1e-12)
    w = np.linalg.solve(cov + lam * np.eye(cov.shape[0]), xc.T @ yc)  # (d_in, d_out)
    # (d_out, r): the fitted outputs' top directions; ordered, so a rank-r map is a prefix of a larger one
    vr = np.linalg.svd(xc @ w, full_matrices=False)[2][:rank].T
    enc, dec = w @ vr, vr.T
    return LowRankMap(enc.astype(np.float32), dec.astype(np.float32), mx.astype(np.float32), my.astype(np.float32))


def fit_joint(x: npt.ArrayLike, y: npt.ArrayLike, rank: int) -> LowRankMap:
    """Joint rank-``rank`` map from ``x`` (N, d_in) to ``y`` (N, d_out): encoder = ``x``'s top principal
    directions, decoder = ``s * Q`` with orthonormal rows ``Q`` (orthogonal Procrustes of the code onto ``y``)."""
    xa = np.asarray(x, dtype=np.float64)
    ya = np.asarray(y, dtype=np.float64)
    if xa.ndim != 2 or ya.ndim != 2 or xa.shape[0] != ya.shape[0] or xa.shape[0] < 2:
        raise ValueError(f"fit_joint: x {xa.shape} and y {ya.shape} must be (N >= 2, d) arrays with the same N")
    if not 1 <= rank <= min(xa.shape[1], ya.shape[1]):
        raise ValueError(f"fit_joint: rank={rank} must be in [1, {min(xa.shape[1], ya.shape[1])}] "
                         "(the smaller state width)")
    mx, my = xa.mean(0), ya.mean(0)
    xc, yc = xa - mx, ya - my
    enc = np.linalg.svd(xc, full_matrices=False)[2][:rank].T  # (d_in, r): the producer's principal directions
    z = xc @ enc  # (N, r)
    a, sv, bt = np.linalg.svd(z.T @ yc, full_matrices=False)  # (r, r), (r,), (r, d_out)
    q = a @ bt  # (r, d_out), orthonormal rows: the rotation that best carries the code onto y
    scale = float(sv.sum()) / max(float((z * z).sum()), 1e-300)
    return LowRankMap(enc.astype(np.float32), (scale * q).astype(np.float32), mx.astype(np.float32),
                      my.astype(np.float32))


def fit_pca(x: npt.ArrayLike, rank: int) -> LowRankMap:
    """The producer's own principal subspace: code = top-``rank`` principal components of ``x`` (N, d), decoded
    back into the same space (no cross-model regression; at full rank the identity)."""
    xa = np.asarray(x, dtype=np.float64)
    if xa.ndim != 2 or xa.shape[0] < 2:
        raise ValueError(f"fit_pca: x {xa.shape} must be an (N >= 2, d) array")
    if not 1 <= rank <= xa.shape[1]:
        raise ValueError(f"fit_pca: rank={rank} must be in [1, {xa.shape[1]}] (the state width)")
    mx = xa.mean(0)
    u = np.linalg.svd(xa - mx, full_matrices=False)[2][:rank].T  # (d, r)
    return LowRankMap(u.astype(np.float32), u.T.copy().astype(np.float32), mx.astype(np.float32), mx.astype(np.float32))


def truncate(m: LowRankMap, rank: int) -> LowRankMap:
    """The rank-``rank`` map contained in ``m`` (its first code channels)."""
    if not 1 <= rank <= m.rank:
        raise ValueError(f"truncate: rank={rank} must be in [1, {m.rank}]")
    return LowRankMap(m.encoder[:, :rank].copy(), m.decoder[:rank].copy(), m.mean_in, m.mean_out)


def relative_error(pred: npt.ArrayLike, target: npt.ArrayLike) -> float:
    """||pred - target|| / ||target|| (Frobenius)."""
    p, t = np.asarray(pred, dtype=np.float64), np.asarray(target, dtype=np.float64)
    return float(np.linalg.norm(p - t) / max(float(np.linalg.norm(t)), 1e-12))


def select_patch_layers(impact: list[float], budget: int | None, keep: float = 0.25) -> list[int]:
    """Transition layers to PATCH, ascending.

    ``impact[l]`` is the measured downstream error when layer ``l`` alone is reconstructed (its local error
    times its amplification). ``budget`` = a fixed count k (0..L) of highest-impact layers; ``None`` = auto:
    the fewest highest-impact layers that leave at most ``keep`` of the summed impact unpatched.
    """
    n = len(impact)
    if any(not np.isfinite(v) or v < 0 for v in impact):
        raise ValueError(f"select_patch_layers: impacts must be finite and >= 0, got {impact}")
    order = sorted(range(n), key=lambda i: (-impact[i], i))
    if budget is not None:
        if not 0 <= budget <= n:
            raise ValueError(f"select_patch_layers: budget={budget} must be in [0, {n}] (the number of layers)")
        return sorted(order[:budget])
    if not 0.0 <= keep < 1.0:
        raise ValueError(f"select_patch_layers: keep={keep} must be in [0, 1)")
    total, left, chosen = float(sum(impact)), float(sum(impact)), []
    for i in order:
        if left <= keep * total:
            break
        chosen.append(i)
        left -= impact[i]
    return sorted(chosen)
