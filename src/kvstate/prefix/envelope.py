"""Vectorised upper convex hull of x-sorted points — the convex-hull-trick engine behind the exact
placement DP of sparse prefix caching (Theorem 2) in :mod:`kvstate.prefix.placement`.

``upper_hull(x, y)`` returns the vertices of the upper hull of points with strictly increasing ``x``.
A sequential monotone chain is ``O(n)`` but a Python loop over 10^5 points per DP layer is too slow,
so the hull is found with whole-array NumPy steps:

1. drop every reflex vertex (on or below the chord of its two neighbours) at once — safe, since such
   a point is never a hull vertex. Only survivors next to a dropped point can turn reflex, so after
   the first full pass only those "suspects" are re-tested.
2. when dropping stalls — a far point dominating a long concave run would peel one vertex per pass —
   the chain is a few concave runs; each pair of adjacent runs is joined by its bridge (upper common
   tangent), found for all pairs at once by alternating tangents (from a point of one run, the
   extreme-slope point of the other, and back; a few whole-array segment reductions per step), and
   the points under each bridge are dropped.

A chain with no reflex vertex is concave, hence is the upper hull. Before the passes, the candidates are
cut to the vertices of the least concave majorant found by the pool-adjacent-violators algorithm
(``scipy.optimize.isotonic_regression`` on the chord slopes, in C): on the placement DP's layers that
is the hull already, and the passes only confirm it. Every step only removes points
lying under a segment between two remaining points, so the result is exact up to float rounding of
the orientation tests. Ignores: lower hulls and unsorted input (callers pass sorted grids).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
from scipy.optimize import isotonic_regression

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]
# bridge the runs once reflex vertices are at most max(_MIN_BRIDGE, chain >> _BRIDGE_SHIFT)
_MIN_BRIDGE = 16
_BRIDGE_SHIFT = 7
_WALK_MAX_CHAIN = 8192  # longer chains bridge by binary search (O(pairs) per step, not O(chain))
_BRIDGE_STEPS = 8  # alternating-tangent steps before the unsettled pairs go to the binary search


def upper_hull(x: FloatArray, y: FloatArray) -> IntArray:
    """Indices of the upper-hull vertices of ``(x[i], y[i])``, ``x`` strictly increasing, in order.

    Collinear middle points are dropped, so consecutive hull edges have strictly decreasing slopes.
    The candidates come from the least concave majorant (:func:`_majorant_vertices`, one C call); the
    whole-array passes then only confirm them (and drop what rounding let through).
    """
    if x.size > 3:
        cand = _majorant_vertices(x, y)
        if cand.size < x.size:
            return cand.take(_hull_passes(x.take(cand), y.take(cand)))
    return _hull_passes(x, y)


def _majorant_vertices(x: FloatArray, y: FloatArray) -> IntArray:
    """The vertices of the least concave majorant of ``(x, y)``: its slopes are the antitonic regression of
    the chord slopes weighted by their widths (the pool-adjacent-violators algorithm, SciPy's C code), so
    the majorant's edges are the pooled blocks and its vertices their starts (plus the last point)."""
    dx = np.diff(x)
    blocks: IntArray = isotonic_regression(np.diff(y) / dx, weights=dx, increasing=False).blocks
    return blocks.astype(np.int64, copy=False)


def _hull_passes(x: FloatArray, y: FloatArray) -> IntArray:
    """The upper hull by whole-array passes (see the module docstring): drop reflex vertices, bridge runs."""
    # cross >= 0: the middle point is on or below the chord of its neighbours (not a vertex)
    cross = (x[1:-1] - x[:-2]) * (y[2:] - y[:-2]) - (y[1:-1] - y[:-2]) * (x[2:] - x[:-2])
    reflex = np.flatnonzero(cross >= 0) + 1
    chain = np.arange(x.size, dtype=np.int64)  # surviving point indices, in x order
    while reflex.size:
        drop = np.zeros(chain.size + 1, dtype=np.int64)
        drop[reflex] += 1
        drop[reflex + 1] -= 1
        # Few reflex vertices left: the chain is a few concave runs, possibly a long run dominated by
        # a far point that plain drops would peel one vertex per pass — bridge the runs instead.
        if reflex.size <= max(_MIN_BRIDGE, chain.size >> _BRIDGE_SHIFT):
            p, q = _run_bridges(x, y, chain, reflex)
            drop[p + 1] += 1  # drop chain positions p+1 .. q-1 (covers the reflex vertices between)
            drop[q] -= 1
        kept = np.flatnonzero(np.cumsum(drop[:-1]) <= 0)
        chain = chain.take(kept)  # take() with indices is much faster than a boolean mask here
        # only survivors next to a dropped point can have turned reflex
        gap = np.flatnonzero(np.diff(kept) > 1)
        mark = np.zeros(chain.size, dtype=bool)
        mark[gap] = mark[gap + 1] = True
        mark[0] = mark[-1] = False  # the end points are always vertices
        mid = np.flatnonzero(mark)
        reflex = mid[_orient(x, y, chain.take(mid - 1), chain.take(mid), chain.take(mid + 1)) >= 0]
    return chain


def _orient(x: FloatArray, y: FloatArray, a: IntArray, b: IntArray, c: IntArray) -> FloatArray:
    """Orientation of (a, b, c): > 0 when b lies strictly above the line a -> c (x_a < x_b < x_c)."""
    xa, ya = x.take(a), y.take(a)
    res: FloatArray = (x.take(b) - xa) * (y.take(c) - ya) - (y.take(b) - ya) * (x.take(c) - xa)
    return res


def _run_bridges(
    x: FloatArray, y: FloatArray, chain: IntArray, reflex: IntArray
) -> tuple[IntArray, IntArray]:
    """Bridges between adjacent concave runs, the runs being the maximal stretches free of ``reflex``.

    Returns chain positions ``(p, q)`` per settled pair; pairs the search could not settle are left out.
    """
    step = np.diff(reflex) > 1
    first = np.concatenate(([True], step))  # first reflex vertex of each gap between runs
    last = np.concatenate((step, [True]))
    starts = np.concatenate(([0], reflex[last] + 1))
    ends = np.concatenate((reflex[first] - 1, [chain.size - 1]))
    p, q = _bridges(x, y, chain, starts[:-1], ends[:-1], starts[1:], ends[1:])
    ok = p >= 0
    return p[ok], q[ok]


def _bridges(
    x: FloatArray, y: FloatArray, chain: IntArray, sa: IntArray, ea: IntArray, sb: IntArray, eb: IntArray
) -> tuple[IntArray, IntArray]:
    """Bridge ``(p, q)`` between runs ``chain[sa..ea]`` and ``chain[sb..eb]`` (A left of B), per pair.

    Alternating tangents, all pairs at once: from ``p`` (first the inner end of A) the tangent point
    ``q`` of B is the point with the largest slope from ``p`` (the rightmost on ties); from ``q`` the
    tangent point of A is the one with the smallest slope to ``q`` (the leftmost on ties). ``p`` only
    moves left and ``q`` only right, and at a fixed point every point of A and B lies on or under the
    line ``p q``: the upper common tangent. Each step is a handful of whole-array operations over the
    runs (segment reductions), and a few steps settle a pair on the planner's inputs. ``p = q = -1``
    marks a pair that did not settle (rounding in near-collinear input); callers then keep its points.
    Each step costs ``O(chain)``, so chains over ``_WALK_MAX_CHAIN`` points, and the pairs still
    unsettled after ``_BRIDGE_STEPS`` steps, go to the simultaneous binary search of
    :func:`_bridges_search` (``O(log n)`` steps of ``O(pairs)``).
    """
    if chain.size > _WALK_MAX_CHAIN:  # each step costs O(chain): long chains take the binary search
        return _bridges_search(x, y, chain, sa, ea, sb, eb)
    la, lb = ea - sa + 1, eb - sb + 1
    a_pos, a_seg, a_off = _ranges(sa, la)
    b_pos, b_seg, b_off = _ranges(sb, lb)
    a_pts, b_pts = chain.take(a_pos), chain.take(b_pos)
    xa, ya, xb, yb = x.take(a_pts), y.take(a_pts), x.take(b_pts), y.take(b_pts)
    p, q = ea.copy(), np.full(sa.size, -1, dtype=np.int64)
    for _ in range(_BRIDGE_STEPS):
        pp = chain.take(p)
        px, py = x.take(pp).take(b_seg), y.take(pp).take(b_seg)
        s = (yb - py) / (xb - px)  # slope from p to each point of B
        q_new = np.maximum.reduceat(np.where(s >= np.maximum.reduceat(s, b_off).take(b_seg), b_pos, -1), b_off)
        qq = chain.take(q_new)
        qx, qy = x.take(qq).take(a_seg), y.take(qq).take(a_seg)
        s = (qy - ya) / (qx - xa)  # slope from each point of A to q
        big = chain.size
        p_new = np.minimum.reduceat(np.where(s <= np.minimum.reduceat(s, a_off).take(a_seg), a_pos, big), a_off)
        settled = (p_new == p) & (q_new == q)
        p, q = p_new, q_new
        if settled.all():
            return p, q
    rest = np.flatnonzero(~settled)
    p2, q2 = _bridges_search(x, y, chain, sa[rest], ea[rest], sb[rest], eb[rest])
    p[rest], q[rest] = p2, q2
    return p, q


def _ranges(start: IntArray, length: IntArray) -> tuple[IntArray, IntArray, IntArray]:
    """Concatenated ``start[k] .. start[k] + length[k] - 1``, the segment id of each, the offsets."""
    off = np.concatenate(([0], np.cumsum(length)[:-1]))
    seg = np.repeat(np.arange(start.size), length)
    pos = np.arange(int(length.sum()), dtype=np.int64) - off.take(seg) + start.take(seg)
    return pos, seg, off


def _bridges_search(
    x: FloatArray, y: FloatArray, chain: IntArray, sa: IntArray, ea: IntArray, sb: IntArray, eb: IntArray
) -> tuple[IntArray, IntArray]:
    """Bridge ``(p, q)`` between concave runs ``chain[sa..ea]`` and ``chain[sb..eb]``, per pair (the
    pairs alternating tangents did not settle quickly: long runs).

    Simultaneous binary search (Overmars & van Leeuwen): with ``L`` the line through the midpoints
    ``a_i`` and ``b_j``,

    * ``a_{i-1}`` above L → p < i;  a_i supports A (no neighbour above) → p <= i
    * ``b_{j+1}`` above L → q > j;  b_j supports B → q >= j
    * ``a_{i+1}`` above L and b_j supports → p > i (and mirrored for B)
    * ``a_{i+1}`` and ``b_{j-1}`` both above L: compare the two edge lines at the separator x —
      A's line higher → p > i, B's line higher → q < j.

    Each step halves one range, so ``O(log n)`` steps. ``p = q = -1`` marks a pair the search could
    not settle (only possible through rounding in near-collinear input); callers then keep its points.
    """
    lo_a, hi_a, lo_b, hi_b = sa.copy(), ea.copy(), sb.copy(), eb.copy()
    p = np.full(sa.size, -1, dtype=np.int64)
    q = np.full(sa.size, -1, dtype=np.int64)
    sep = 0.5 * (x.take(chain.take(ea)) + x.take(chain.take(sb)))
    pair = np.arange(sa.size)  # pairs still searching
    for _ in range(4 * int(np.log2(chain.size + 1)) + 8):
        i, j = (lo_a + hi_a) >> 1, (lo_b + hi_b) >> 1
        # rows: a_i, b_j, then neighbours a_{i-1}, a_{i+1}, b_{j-1}, b_{j+1} clamped to their run
        pos = np.stack(
            (i, j, np.maximum(i - 1, sa), np.minimum(i + 1, ea), np.maximum(j - 1, sb), np.minimum(j + 1, eb))
        )
        pts = chain.take(pos)
        px, py = x.take(pts), y.take(pts)  # (6, pairs)
        xa, ya, xb, yb = px[0], py[0], px[1], py[1]
        above = (xb - xa) * (py[2:] - ya) - (yb - ya) * (px[2:] - xa) > 0
        above &= pos[2:] != pos[[0, 0, 1, 1]]  # a clamped neighbour is the point itself
        a_left, a_right, b_left, b_right = above
        a_sup, b_sup = ~(a_left | a_right), ~(b_left | b_right)
        done = a_sup & b_sup
        p[pair[done]], q[pair[done]] = i[done], j[done]
        hi_a = np.where(a_left, i - 1, np.where(a_sup, i, hi_a))
        lo_b = np.where(b_right, j + 1, np.where(b_sup, j, lo_b))
        lo_a = np.where(a_right & b_sup, i + 1, lo_a)
        hi_b = np.where(b_left & a_sup, j - 1, hi_b)
        both = a_right & b_left
        if both.any():
            # edge lines a_i a_{i+1} and b_{j-1} b_j evaluated at the separator between the runs
            line_a = ya + (py[3] - ya) / np.where(both, px[3] - xa, 1.0) * (sep - xa)
            line_b = yb - (yb - py[4]) / np.where(both, xb - px[4], 1.0) * (xb - sep)
            lo_a = np.where(both & (line_a >= line_b), i + 1, lo_a)
            hi_b = np.where(both & (line_a <= line_b), j - 1, hi_b)
        # rounding can empty a range; such a pair is dropped unsettled
        live = ~done & (lo_a <= hi_a) & (lo_b <= hi_b)
        if not live.all():
            if not live.any():
                break
            pair, sa, ea, sb, eb, sep = pair[live], sa[live], ea[live], sb[live], eb[live], sep[live]
            lo_a, hi_a, lo_b, hi_b = lo_a[live], hi_a[live], lo_b[live], hi_b[live]
    return p, q
