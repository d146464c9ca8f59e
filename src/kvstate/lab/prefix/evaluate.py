"""Recurrent work saved by each placement method on the seed-000-shaped workloads (pure; no torch).

For a workload's overlap-depth histogram ``w`` (pooled over its requests), a checkpoint set ``C`` saves
``sum_t w_t l(t; C)`` of the ``sum_t w_t t`` overlapping tokens a request stream would otherwise
recompute. ``savings_table`` sweeps the slot budget ``M`` for every method; ``match_block`` finds the
fewest optimal checkpoints that save as much as block caching every ``block`` tokens (the paper's
"block-64 savings at a fraction of the bytes" comparison).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvstate.lab.workloads.traces import generate, overlap_weights
from kvstate.prefix.placement import METHODS, expected_recompute, plan_checkpoints


@dataclass(frozen=True)
class SavingsRow:
    workload: str
    method: str
    slots: int  # checkpoint budget M
    positions: int  # checkpoints actually placed
    saved_fraction: float  # share of overlapping tokens not recomputed, in [0, 1]


def workload_weights(workload: str, n_requests: int = 400, seed: int = 0, scale: float = 1.0) -> np.ndarray:
    return overlap_weights(generate(workload, n_requests, seed=seed, scale=scale))


def saved_fraction(w: np.ndarray, positions: list[int]) -> float:
    overlap_tokens = float(np.dot(w, np.arange(len(w))))
    if overlap_tokens <= 0:
        return 0.0
    return 1.0 - expected_recompute(w, positions) * float(w.sum()) / overlap_tokens


def savings_table(
    w: np.ndarray, workload: str, budgets: list[int], methods: tuple[str, ...] = METHODS, align: int = 64
) -> list[SavingsRow]:
    rows = []
    for m in budgets:
        for method in methods:
            pos = plan_checkpoints(w, m, method, align)
            rows.append(SavingsRow(workload, method, m, len(pos), saved_fraction(w, pos)))
    return rows


def match_block(w: np.ndarray, block: int = 64, align: int = 64) -> tuple[int, int, float]:
    """(checkpoints block caching keeps, fewest optimal checkpoints saving as much, block's saved fraction)."""
    n = len(w) - 1
    block_pos = plan_checkpoints(w, n // block, "block", align, block_size=block)
    target = saved_fraction(w, block_pos)
    lo, hi = 1, max(1, len(block_pos))
    while lo < hi:  # savings are monotone in M for the exact planner
        mid = (lo + hi) // 2
        if saved_fraction(w, plan_checkpoints(w, mid, "optimal", align)) >= target - 1e-12:
            hi = mid
        else:
            lo = mid + 1
    return len(block_pos), lo, target


def match_block_per_entry(workload: str, n_requests: int = 400, seed: int = 0, block: int = 64,
                          align: int = 64) -> tuple[int, int]:
    """Per cached entry (one per prefix_id, its own overlap histogram): total checkpoints block caching keeps
    vs the fewest optimal checkpoints that save as much on every entry."""
    reqs = generate(workload, n_requests, seed=seed)
    total_block = total_opt = 0
    for pid in sorted({r.prefix_id for r in reqs if r.prefix_id is not None}):
        w = overlap_weights(reqs, pid, length=max(r.length for r in reqs if r.prefix_id == pid))
        if float(np.dot(w, np.arange(len(w)))) <= 0:
            continue  # never reused: neither scheme saves anything on it
        n_block, n_opt, _ = match_block(w, block, align)
        total_block += n_block
        total_opt += n_opt
    return total_block, total_opt
