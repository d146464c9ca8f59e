"""Rank allocation of the slow tier under a byte budget (pure: NumPy only, no torch).

From "SEKV: Resolution-Adaptive Semantic KV Cache with Hierarchical Semantic Memory": the slow tier keeps
each span's K and V as low-rank factors; the rank-gate predictor proposes a rank per span (its cap here),
and the slow-tier budget decides how much of it is kept. Each span starts at rank 1; the remaining bytes
go, one rank at a time, to the span whose next singular value carries the most energy per byte
(``sum over heads of s_r^2`` / the bytes of one more rank). Every span's energies are non-increasing
in ``r`` and its cost per rank is constant, so with equal costs this greedy choice maximises the
retained energy within the caps (an exchange argument; the tests check it against brute force); with
unequal costs it is the greedy knapsack, at most one rank's energy from the fractional optimum.
The span store passes each matrix's energies as fractions of its total (the relative energy), so the
allocation minimises the summed relative error of every span's keys and values rather than letting the
values' larger absolute energy starve the keys. Ignored: interactions between spans (each span is
reconstructed on its own).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt


def rank_cost(n_tokens: int, head_dim: int, heads: int, element_size: int) -> int:
    """Bytes of one rank of one span's factors over its heads: ``A`` (H, n, 1) + ``B`` (H, 1, D)."""
    return heads * (n_tokens + head_dim) * element_size


def allocate_ranks(gains: Sequence[npt.NDArray[np.float64]], costs: Sequence[int], caps: Sequence[int],
                   budget: int) -> npt.NDArray[np.int64]:
    """Ranks in ``[1, caps[i]]`` with ``sum(ranks * costs) <= budget``, maximising the retained gain.

    ``gains[i][r]``: the energy the ``r+1``-th rank of item ``i`` adds (non-increasing in ``r``);
    ``costs[i]``: bytes per rank. Raises ``ValueError`` naming the minimum when one rank each does not fit.
    """
    n = len(costs)
    if not len(gains) == len(caps) == n:
        raise ValueError(f"allocate_ranks: {len(gains)} gains, {n} costs, {len(caps)} caps; pass one of each per item")
    if any(c <= 0 for c in costs) or any(k < 1 for k in caps):
        raise ValueError("allocate_ranks: costs must be > 0 and caps >= 1")
    need = int(sum(costs))
    if need > budget:
        raise ValueError(f"a slow-tier budget of {budget} bytes is below one rank per span: the minimum is {need} bytes")
    ranks = np.ones(n, dtype=np.int64)
    left = budget - need
    heap = [(-float(gains[i][1]) / costs[i], i) for i in range(n) if caps[i] > 1 and len(gains[i]) > 1]
    heapq.heapify(heap)
    while heap:
        _, i = heapq.heappop(heap)
        if costs[i] > left:
            continue  # this item's next rank does not fit; cheaper items may still
        ranks[i] += 1
        left -= costs[i]
        r = int(ranks[i])
        if r < caps[i] and r < len(gains[i]):
            heapq.heappush(heap, (-float(gains[i][r]) / costs[i], i))
    return ranks
