"""Checkpoint placement inside one retained prefix — sparse prefix caching ("Sparse Prefix Caching for Hybrid and Recurrent LLM Serving").

A prefix of ``N`` tokens may keep at most ``M`` recurrent-state checkpoints; position ``c`` is the
state after the first ``c`` tokens. A future request overlapping the prefix to depth ``t`` restores
the deepest checkpoint ``l(t; C) = max({0} ∪ {c in C: c <= t})`` and recomputes ``r(t; C) = t - l``
tokens. Given overlap-depth weights ``w_t`` (t = 0..N) we minimise ``sum_t w_t r(t; C)``
(the one-sided weighted k-median on a line).

Methods (planners, registered objects in ``PLANNERS``; :func:`register_planner` adds one, :func:`get_planner`
looks one up and lists the registry for an unknown name): ``optimal`` (exact DP, Theorem 2), ``balanced`` (even
spacing, optimal for uniform weights, Theorem 1) and the paper's baselines ``block``, ``log``, ``sqrt``, plus
``junction`` (Marconi-style: checkpoint the most frequent overlap depths). Where the prefix store plans is
one :class:`Placement` mode — ``path`` (a planner on each request's path) or ``tree`` (the exact DP over a bounded
subtree, :mod:`kvstate.prefix.tree_plan`); :meth:`Placement.parse` is the one check of that option.

The exact DP works on savings instead of cost. With ``G(c) = sum_{t >= c} w_t`` and ``c_0 = 0``,
``sum_t w_t l(t; C) = sum_k (c_k - c_{k-1}) G(c_k)`` (Abel summation), so with ``f_m[j]`` the best
savings of at most ``m`` checkpoints whose deepest is ``j``::

    f_m[j] = g_j G_j + max_i ( f_{m-1}[i] - g_i G_j )          (i = 0 is the empty set, f = 0)

a max of lines with slopes ``-g_i`` queried at ``x = G_j``. The max may range over *all* ``i``, not only
``i < j``: a set ending at ``i >= j`` truncated below ``j`` is never worse (G is non-increasing), so
the unconstrained envelope equals the constrained one and a layer is an *offline* envelope problem:
the upper envelope of the lines, i.e. the upper convex hull of ``(g_i, f_{m-1}[i])``, at every query. Grid points
whose cell ``[g, g + align)`` holds no mass are dominated and dropped first (``K <= N // align``).

Complexity, honestly: the paper's ``O(NM)`` uses a sequential monotone convex-hull trick; a Python
loop of ``N * M`` steps is far too slow here, so each layer is a few whole-array NumPy steps around two
C calls: :func:`kvstate.prefix.envelope.tangent_points` gives every chord of ``(g_i, f_{m-1}[i])`` the
slope of the hull edge above it (pool-adjacent-violators, ``O(K)``) and finds each query's tangent
point by binary search (``O(K log K)``, the largest single cost); no hull is built. Overall
``O(M K log K)`` time and ``O(M K)`` int32 back-pointers (32 MiB at ``K = 131072, M = 64``); the layer
loop stops early once another slot changes nothing. Measured numbers are in
``benchmarks/prefix_planner.py``. Depths beyond the last checkpoint and before the first one need
no special case in the savings form.

All-zero weights raise ``ValueError``: every placement then costs the same and the expected recompute
is undefined; callers smooth a cold histogram (``OverlapHistogram(alpha > 0)``) or pass a prior.

Ignores: admission/eviction across entries (that is the store's job) and prefix trees (see
:mod:`kvstate.prefix.tree_placement`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum

import numpy as np
import numpy.typing as npt

from kvstate.errors import KVStateError
from kvstate.prefix.envelope import tangent_points

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

MAX_PLAN_BYTES = 4 * 2**30  # the exact planner's back-pointers beyond this are refused before allocating


class Placement(StrEnum):
    """Where the prefix store plans checkpoints; a ``str``, so configs and JSON read and write "path" / "tree"."""

    PATH = "path"  # a registered planner on each request's path (this module)
    TREE = "tree"  # the exact DP over a bounded subtree of the radix tree (kvstate.prefix.tree_plan)

    @classmethod
    def parse(cls, value: object, option: str = "placement",
              error: type[KVStateError] = KVStateError) -> Placement:
        """``value`` as a mode (a member or its exact name); anything else raises ``error`` naming the option."""
        if isinstance(value, str):
            for mode in cls:
                if value == mode.value:
                    return mode
        raise error(f"{option}={value!r} is not a placement; choose one of {', '.join(m.value for m in cls)} "
                    "('tree': exact placement over a bounded subtree of the radix tree)")


def _weights(weights: npt.ArrayLike) -> FloatArray:
    """Validate overlap-depth weights and return them as float64 scaled to sum 1."""
    try:
        raw = np.asarray(weights)
        if raw.dtype.kind not in "biuf":  # complex parts would be dropped, strings parsed: refuse both
            raise TypeError(f"dtype {raw.dtype} is not real numbers")
        with np.errstate(over="ignore"):
            w = raw.astype(np.float64, copy=False)  # read only: the scaled copy below is the result
    except (TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"weights: cannot be read as numbers ({exc}); pass a 1-D array of real floats") from None
    if w.ndim != 1 or w.size < 2:
        raise ValueError(
            f"weights: expected a 1-D array of length N+1 >= 2 (one weight per overlap depth 0..N), "
            f"got shape {w.shape}; pass np.asarray(weights).ravel() of the per-depth weights"
        )
    low, peak = float(w.min()), float(w.max())  # a NaN reaches both, an inf one of them
    if not (math.isfinite(low) and math.isfinite(peak)):
        raise ValueError("weights: contains NaN or inf; pass finite per-depth weights")
    if low < 0:
        raise ValueError(f"weights: contains negative entries (min {low:g}); pass probabilities or counts >= 0")
    if peak <= 0.0:
        raise ValueError(
            "weights: all zero, so no overlap depth has any probability and every placement costs the "
            "same; pass at least one positive weight (e.g. a uniform prior np.ones(N+1)) or use "
            "OverlapHistogram with alpha > 0 before any request was observed"
        )
    scaled: FloatArray = w / peak  # first: the sum of huge finite weights (1e308 each) would overflow to inf
    scaled /= float(scaled.sum())
    return scaled


def _check_slots_align(slots: int, align: int, n: int) -> None:
    if isinstance(slots, bool) or not isinstance(slots, (int, np.integer)) or slots < 0:
        raise ValueError(f"slots: must be an int >= 0 (number of checkpoints to keep), got {slots!r}")
    if isinstance(align, bool) or not isinstance(align, (int, np.integer)) or not 1 <= align <= n:
        raise ValueError(
            f"align: must be an int in 1..N={n} (positions are multiples of align, e.g. the model's "
            f"chunk size), got {align!r}"
        )


def plan_checkpoints(
    weights: npt.ArrayLike,
    slots: int,
    method: str = "optimal",
    align: int = 1,
    *,
    block_size: int = 64,
) -> list[int]:
    """Choose at most ``slots`` checkpoint positions in ``1..N`` (multiples of ``align``), sorted.

    ``weights[t] >= 0`` is the probability (or count) that a request overlaps the prefix to depth
    exactly ``t`` (t = 0..N); it need not sum to 1 but must not be all zero (ValueError). Methods:

    - ``optimal``: exact minimum of the expected recompute over the grid; returns fewer than ``slots``
      positions when more cannot lower it (e.g. no weight lies deeper).
    - ``balanced``: the ``M + 1`` stretches (before the first, between, after the last checkpoint)
      within one grid step of each other, the uniform-weight optimum (Theorem 1).
    - ``block``: every multiple of ``block_size`` (rounded up to a multiple of ``align``), the first
      ``slots``.
    - ``log``: ``align * 2^k`` (dyadic on the grid), the deepest ``slots``.
    - ``sqrt``: every multiple of ``ceil(sqrt N)`` rounded up to ``align``, the first ``slots``.
    - ``junction``: Marconi-style, the ``slots`` grid cells ``[g, g + align)`` with the most overlap
      mass (deeper first on ties), i.e. the most frequent overlap depths snapped down to the grid.

    Only ``optimal`` and ``junction`` read the weights.
    """
    planner = get_planner(method)
    w = _weights(weights)
    n = w.size - 1
    _check_slots_align(slots, align, n)
    if int(slots) == 0:
        return []
    bad_block = isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)) or block_size < 1
    if bad_block and "block_size" in planner.options:  # the option is checked only where it is read
        raise ValueError(f"block_size: must be an int >= 1 (tokens per block), got {block_size!r}")
    return planner.plan(w, int(slots), int(align), 0 if bad_block else int(block_size))


PlanFn = Callable[[FloatArray, int, int, int], list[int]]  # (scaled weights, slots >= 1, align, block_size)


@dataclass(frozen=True)
class Planner:
    """A checkpoint placement method: ``plan(weights, slots, align, block_size)`` -> sorted positions in ``1..N``.

    ``weights`` are validated and scaled to sum 1; ``slots >= 1`` and ``align`` in ``1..N`` are checked before
    the call. ``reads_weights``: whether the plan depends on the overlap histogram (else it is fixed by N).
    """

    name: str
    plan: PlanFn
    reads_weights: bool
    about: str  # one line for a CLI's choices
    options: tuple[str, ...] = ()  # keyword options of plan_checkpoints it reads (e.g. "block_size")


PLANNERS: dict[str, Planner] = {}


def register_planner(planner: Planner) -> Planner:
    """Add a planner to the registry (a name already taken is refused); returns it."""
    if not isinstance(planner, Planner) or not planner.name or planner.name in PLANNERS:
        raise ValueError(f"register_planner: {getattr(planner, 'name', planner)!r} is not a new Planner name "
                         f"(registered: {', '.join(PLANNERS)})")
    PLANNERS[planner.name] = planner
    return planner


def unregister_planner(name: str) -> None:
    """Remove a planner (tests registering a toy one)."""
    PLANNERS.pop(name, None)


def get_planner(name: str) -> Planner:
    """The registered planner called ``name``; an unknown name lists the registry (ValueError)."""
    if not isinstance(name, str) or name not in PLANNERS:
        raise ValueError(f"method: unknown {name!r}; choose one of {', '.join(PLANNERS)}")
    return PLANNERS[name]


def planner_names() -> tuple[str, ...]:
    """Registered planner names, in registration order (the CLI's choices)."""
    return tuple(PLANNERS)


def _plan_block(w: FloatArray, slots: int, align: int, block_size: int) -> list[int]:
    n = w.size - 1
    step = -(-int(block_size) // align) * align  # round up to the grid
    return list(range(step, n + 1, step))[:slots]


def _plan_log(w: FloatArray, slots: int, align: int, block_size: int) -> list[int]:
    grid_size = (w.size - 1) // align
    dyadic = [align << k for k in range(grid_size.bit_length())]  # align * 2^k <= N
    return dyadic[-slots:]


def _plan_sqrt(w: FloatArray, slots: int, align: int, block_size: int) -> list[int]:
    n = w.size - 1
    step = math.isqrt(n)
    step += step * step < n  # ceil(sqrt N)
    step = -(-step // align) * align
    return list(range(step, n + 1, step))[:slots]


for _p in (
    Planner("optimal", lambda w, m, a, b: _optimal(w, m, a), True, "exact minimum of the expected recompute (DP)"),
    Planner("balanced", lambda w, m, a, b: _balanced(w.size - 1, m, a), False,
            "even stretches; optimal for uniform weights"),
    Planner("block", _plan_block, False, "every multiple of block_size", ("block_size",)),
    Planner("log", _plan_log, False, "dyadic positions align * 2^k, the deepest"),
    Planner("sqrt", _plan_sqrt, False, "every multiple of ceil(sqrt N)"),
    Planner("junction", lambda w, m, a, b: _junction(w, m, a), True, "Marconi-style: the most frequent depths"),
):
    register_planner(_p)

METHODS: tuple[str, ...] = planner_names()  # the built-in planners (the registry may grow: use planner_names())


def expected_recompute(weights: npt.ArrayLike, positions: Iterable[int]) -> float:
    """``sum_t w_t (t - l(t; C)) / sum_t w_t`` — expected tokens recomputed per request."""
    w = _weights(weights)
    n = w.size - 1
    c = _positions(positions, n)
    depth = np.arange(n + 1)
    # deepest checkpoint <= t (0 = start from scratch)
    idx = np.searchsorted(c, depth, side="right")  # number of checkpoints <= t
    served = np.concatenate(([0], c))[idx]
    return float(np.dot(w, depth - served))


def _positions(positions: Iterable[int], n: int) -> IntArray:
    raw = np.asarray(list(positions))
    if raw.size and (raw.ndim != 1 or not np.all(np.isfinite(raw)) or np.any(raw != np.round(raw))):
        raise ValueError(
            f"positions: expected integer checkpoint positions (a 1-D sequence), got {raw.tolist()!r}"
        )
    c = np.unique(raw.astype(np.int64))
    if c.size and (c[0] < 1 or c[-1] > n):
        raise ValueError(
            f"positions: checkpoint positions must lie in 1..N={n} (c = state after the first c tokens), "
            f"got min {int(c[0])}, max {int(c[-1])}"
        )
    return c


def _balanced(n: int, slots: int, align: int) -> list[int]:
    """Even spacing on the grid: optimal for uniform weights (Theorem 1).

    Stretch lengths ``L_0 = c_1, L_k = c_{k+1} - c_k, L_M = N + 1 - c_M`` sum to ``N + 1`` and cost
    ``L (L - 1) / 2`` each under uniform weights; the first ``M`` are multiples of ``align``. For each
    total ``s`` grid steps taken by the first ``M`` stretches the convex cost is minimised by splitting
    ``s`` as evenly as possible, so we scan every ``s`` in closed form and keep the cheapest. At the
    optimum all ``M + 1`` stretches differ by at most one grid step.
    """
    m = min(slots, n // align)
    s = np.arange(m, n // align + 1, dtype=np.int64)  # grid steps used by the first m stretches
    q, r = np.divmod(s, m)
    big, small, last = (q + 1) * align, q * align, n + 1 - s * align
    cost = r * big * (big - 1) + (m - r) * small * (small - 1) + last * (last - 1)
    best = int(s[int(np.argmin(cost))])
    q0, r0 = divmod(best, m)
    steps = [q0 + 1] * r0 + [q0] * (m - r0)  # larger stretches first
    return [int(v) * align for v in np.cumsum(steps)]


def _junction(w: FloatArray, slots: int, align: int) -> list[int]:
    """Marconi-style: the ``slots`` grid cells holding the most overlap mass (depth >= 1, snapped down)."""
    n = w.size - 1
    grid = np.arange(align, n + 1, align)
    cell = np.add.reduceat(w, grid)  # mass of depths [g, g + align), last cell up to N
    order = np.lexsort((-grid, -cell))  # most mass first, deeper first on ties
    chosen = grid[order[cell[order] > 0][:slots]]
    return sorted(int(v) for v in chosen)


def _optimal(w: FloatArray, slots: int, align: int) -> list[int]:
    """Exact layered DP over the candidate grid points (see the module docstring for the recurrence)."""
    n = w.size - 1
    grid = np.arange(align, n + 1, align)
    # A grid point whose cell [g, g + align) holds no mass is dominated by the next one (moving a
    # checkpoint deeper through an empty cell never loses), so only cells with mass are candidates.
    cell = np.add.reduceat(w, grid)  # mass of depths [g, g + align), the last cell up to N
    keep = cell > 0
    cand = grid[keep]
    if cand.size <= slots:
        return [int(v) for v in cand]
    need = 4 * slots * (cand.size + 1)  # int32 back-pointers, one row per slot
    if need > MAX_PLAN_BYTES:
        raise ValueError(
            f"slots: the exact planner would need {need / 2**30:.1f} GiB for {slots} slots over {cand.size:,} "
            f"candidate depths (limit {MAX_PLAN_BYTES / 2**30:.0f} GiB); pass fewer slots, a larger align, "
            "or method 'balanced'"
        )
    g = np.concatenate(([0.0], cand.astype(np.float64)))  # line slopes -g_i; index 0 = no checkpoint
    survival = np.cumsum(cell[::-1])[::-1]  # G(g) = mass of depths >= g, per grid point
    x = np.concatenate(([0.0], survival[keep]))  # query points G_j, non-increasing in j
    base = g * x  # g_j G_j: savings of the deepest checkpoint alone
    f = base.copy()  # layer 1: one checkpoint
    args: list[npt.NDArray[np.int32]] = [np.zeros(g.size, dtype=np.int32)]
    dg = np.diff(g)
    for _ in range(2, slots + 1):
        k = tangent_points(dg, f, x)  # the best previous checkpoint for each j (module docstring)
        nxt = f.take(k)
        nxt -= g.take(k) * x
        nxt += base
        nxt[0] = 0.0
        if np.array_equal(nxt, f):
            break  # another slot changes nothing: later layers would repeat this one
        f = nxt
        args.append(k.astype(np.int32))
    return _backtrack(f, args, cand)


def _backtrack(f: FloatArray, args: Sequence[npt.NDArray[np.int32]], cand: IntArray) -> list[int]:
    j, m = int(np.argmax(f)), len(args)
    out: list[int] = []
    while j > 0:
        out.append(int(cand[j - 1]))
        i = int(args[m - 1][j])
        m -= 1
        # A predecessor at or beyond j only wins by rounding; its set truncated below j is as good.
        while i >= j:
            i = int(args[m - 1][i])
            m -= 1
        j = i
    return sorted(out)


def plan_among(weights: npt.ArrayLike, candidates: Iterable[int], slots: int) -> list[int]:
    """The best at most ``slots`` of the given ``candidates`` (positions in ``1..N``) under the same
    objective, exactly: the savings DP of :func:`plan_checkpoints` over the candidates only, ``O(K^2 M)``
    for ``K`` candidates (meant for a few dozen: a planner's positions plus declared ones). A candidate
    is taken only when it lowers the expected recompute."""
    w = _weights(weights)
    n = w.size - 1
    cand = _positions(candidates, n)
    if isinstance(slots, bool) or not isinstance(slots, (int, np.integer)) or slots < 0:
        raise ValueError(f"slots: must be an int >= 0 (number of checkpoints to keep), got {slots!r}")
    if slots == 0 or cand.size == 0:
        return []
    survival = np.cumsum(w[::-1])[::-1]  # G(t) = mass of depths >= t
    g = np.concatenate(([0.0], cand.astype(np.float64)))  # index 0 = no checkpoint
    x = np.concatenate(([0.0], survival[cand]))
    k, tol = g.size, 1e-12 * max(1.0, float(n))
    earlier = np.tril(np.ones((k, k), dtype=bool), -1)  # [j, i]: i < j, the previous checkpoint is shallower
    f = g * x  # at most one checkpoint, the deepest at j (savings form of the module docstring)
    ptr: list[npt.NDArray[np.int64]] = []  # per added layer: previous checkpoint of j, or -1 (fewer suffice)
    for _ in range(2, min(int(slots), cand.size) + 1):
        gain = np.where(earlier, f[None, :] + (g[:, None] - g[None, :]) * x[:, None], -np.inf)
        arg = np.argmax(gain, axis=1)
        take = gain[np.arange(k), arg] > f + tol  # a checkpoint more must pay off
        if not take.any():
            break
        f = np.where(take, gain[np.arange(k), arg], f)
        ptr.append(np.where(take, arg, -1))
    j = int(np.flatnonzero(f >= f.max() - tol)[0])  # the shallowest best set (deeper ones add nothing)
    out: list[int] = []
    for arg in reversed(ptr):
        if j > 0 and arg[j] >= 0:
            out.append(int(cand[j - 1]))
            j = int(arg[j])
    if j > 0:
        out.append(int(cand[j - 1]))
    return sorted(out)


def plan_quadratic_dp(weights: npt.ArrayLike, slots: int, align: int = 1) -> list[int]:
    """Reference ``O(N^2 M)`` DP in the paper's cost form (for benchmarks and tests, not for serving).

    ``dp[m][j] = min(dp[m-1][j], min_{s <= j on the grid} dp[m-1][s-1] + w(s, j))`` with
    ``w(s, j) = sum_{t=s..j} w_t (t - s)`` from prefix sums, ``dp[0][j] = sum_{t <= j} w_t t``;
    the answer is ``dp[M][N]``.
    """
    w = _weights(weights)
    n = w.size - 1
    _check_slots_align(slots, align, n)
    t = np.arange(n + 1, dtype=np.float64)
    s0 = np.concatenate(([0.0], np.cumsum(w)))  # s0[j+1] = sum_{t<=j} w_t
    s1 = np.concatenate(([0.0], np.cumsum(w * t)))
    grid = np.arange(align, n + 1, align)
    prev = s1[1:].copy()  # dp[0][j]
    choice = []
    for _ in range(min(int(slots), grid.size)):
        cur = prev.copy()
        arg = np.full(n + 1, -1, dtype=np.int64)
        for j in range(align, n + 1):
            s = grid[: j // align]  # checkpoint s serves depths s..j
            cand = prev[s - 1] + (s1[j + 1] - s1[s]) - s * (s0[j + 1] - s0[s])
            b = int(np.argmin(cand))
            if cand[b] < cur[j]:
                cur[j], arg[j] = cand[b], s[b]
        choice.append(arg)
        prev = cur
    out: list[int] = []
    j = n
    for arg in reversed(choice):
        last = int(arg[j])
        if last > 0:
            out.append(last)
            j = last - 1
    return sorted(out)
