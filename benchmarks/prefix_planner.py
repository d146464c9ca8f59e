"""Checkpoint-planner benchmark (sparse prefix caching): speed of the exact DP, the paper-style O(N^2 M) DP it
replaces, and prefix-tree placement against per-entry planning. NumPy only.

1. ``plan_checkpoints(method="optimal")`` at N = 131072, M = 64 on five overlap shapes: median of
   runs after a warm-up, on every depth (align 1) and on the 64-token grid (align 64, target <= 20 ms).
2. The O(N^2 M) reference DP at N = 8192: its layers all cost the same, so it is timed with a few
   layers and scaled linearly to M = 64; the fast DP is timed at the full M = 64, and both plans are
   checked to reach the same expected recompute at the smaller M.
3. Seeded random prefix trees: expected recompute of the exact tree DP vs planning each root-to-leaf
   entry on its own with a mass-proportional budget share.

Prints a fixed-width table, then one JSON line.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import numpy as np

from kvstate.prefix.placement import expected_recompute, plan_checkpoints, plan_quadratic_dp
from kvstate.prefix.tree_placement import PrefixTree, plan_independent, plan_tree, tree_expected_recompute

N_BIG, M_BIG, RUNS = 131_072, 64, 5
GRID, GRID_RUNS = 64, 21  # the serving grid: N / 64 = 2,048 candidate depths
N_REF, M_REF_TIMED = 8192, 4
TREES = [(30, 256, 16, 16), (60, 512, 32, 16), (100, 256, 32, 8)]  # (nodes, max edge, slots, align)


def shapes(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    t = np.arange(n + 1, dtype=np.float64)
    return {
        "uniform": np.ones(n + 1),
        "bimodal": np.exp(-0.5 * ((t - 0.3 * n) / (0.03 * n)) ** 2)
        + 0.5 * np.exp(-0.5 * ((t - 0.8 * n) / (0.05 * n)) ** 2),
        "sysprompt": np.exp(-t / (n / 64)) + np.where(t == n, 0.5 * n / 64, 0.0),  # short queries + full hits
        "lognormal": np.exp(-0.5 * ((np.log1p(t) - np.log(n) + 2.5) / 0.8) ** 2),
        "noisy": rng.random(n + 1),
    }


def timed(fn, runs: int) -> tuple[float, object]:  # type: ignore[no-untyped-def]
    out = fn()  # warm-up
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def random_tree(rng: np.random.Generator, nodes: int, max_edge: int) -> PrefixTree:
    parent, edge, mass = [-1], [0], [np.zeros(0)]
    for v in range(1, nodes):
        parent.append(int(rng.integers(0, v)))
        length = int(rng.integers(8, max_edge + 1))
        edge.append(length)
        m = np.zeros(length)
        m[-1] = rng.random() * 4  # requests ending at a node (a full document / turn) ...
        hits = rng.integers(0, length, 3)
        m[hits] += rng.random(3)  # ... and a few diverging mid-edge
        mass.append(m)
    return PrefixTree(tuple(parent), tuple(edge), tuple(mass), root_mass=1.0)


def main() -> int:
    rows: list[tuple[str, str, str]] = []
    result: dict[str, object] = {"n": N_BIG, "slots": M_BIG, "runs": RUNS}

    big = {}
    for name, w in shapes(N_BIG).items():
        sec, plan = timed(lambda w=w: plan_checkpoints(w, M_BIG, "optimal"), RUNS)
        balanced = expected_recompute(w, plan_checkpoints(w, M_BIG, "balanced"))
        big[name] = {"seconds": sec, "expected_recompute": expected_recompute(w, plan), "balanced": balanced}
        rows.append(
            (
                f"optimal DP N={N_BIG} M={M_BIG} [{name}]",
                f"{sec * 1e3:9.1f} ms",
                f"E[r]={big[name]['expected_recompute']:.1f} (balanced {balanced:.1f})",
            )
        )
    result["optimal_seconds"] = big
    result["optimal_seconds_max"] = max(v["seconds"] for v in big.values())

    grid = {}
    for name, w in shapes(N_BIG).items():
        sec, plan = timed(lambda w=w: plan_checkpoints(w, M_BIG, "optimal", align=GRID), GRID_RUNS)
        grid[name] = {"seconds": sec, "expected_recompute": expected_recompute(w, plan)}
        rows.append((f"optimal DP N={N_BIG} M={M_BIG} align={GRID} [{name}]", f"{sec * 1e3:9.1f} ms", ""))
    result["grid_align"] = GRID
    result["grid_runs"] = GRID_RUNS
    result["grid_seconds"] = grid
    result["grid_seconds_max"] = max(v["seconds"] for v in grid.values())

    w = shapes(N_REF)["bimodal"]
    fast_sec, _ = timed(lambda: plan_checkpoints(w, M_BIG, "optimal"), RUNS)
    t0 = time.perf_counter()
    ref_plan = plan_quadratic_dp(w, M_REF_TIMED)
    ref_small = time.perf_counter() - t0
    ref_sec = ref_small * M_BIG / M_REF_TIMED  # every layer of the reference DP does identical work
    same = abs(
        expected_recompute(w, ref_plan) - expected_recompute(w, plan_checkpoints(w, M_REF_TIMED))
    ) <= 1e-9 * max(1.0, expected_recompute(w, ref_plan))
    rows.append(
        (
            f"O(N^2 M) DP N={N_REF} M={M_REF_TIMED} (timed)",
            f"{ref_small * 1e3:9.1f} ms",
            f"same E[r] as fast DP: {same}",
        )
    )
    rows.append((f"O(N^2 M) DP N={N_REF} M={M_BIG} (scaled)", f"{ref_sec * 1e3:9.1f} ms", "linear in M"))
    rows.append(
        (
            f"optimal DP N={N_REF} M={M_BIG}",
            f"{fast_sec * 1e3:9.1f} ms",
            f"speed-up x{ref_sec / fast_sec:,.0f}",
        )
    )
    result["reference"] = {
        "n": N_REF,
        "timed_slots": M_REF_TIMED,
        "quadratic_seconds_timed": ref_small,
        "quadratic_seconds_scaled_to_64": ref_sec,
        "fast_seconds_64": fast_sec,
        "ratio": ref_sec / fast_sec,
        "same_objective": same,
    }

    rng = np.random.default_rng(0)
    trees = []
    for nodes, max_edge, slots, align in TREES:
        tree = random_tree(rng, nodes, max_edge)
        t0 = time.perf_counter()
        tree_plan = plan_tree(tree, slots, align)
        sec = time.perf_counter() - t0
        a = tree_expected_recompute(tree, tree_plan)
        b = tree_expected_recompute(tree, plan_independent(tree, slots, align))
        trees.append(
            {"nodes": nodes, "slots": slots, "align": align, "tree": a, "independent": b, "seconds": sec}
        )
        rows.append(
            (
                f"tree {nodes} nodes M={slots} align={align}",
                f"{sec * 1e3:9.1f} ms",
                f"E[r] tree {a:.1f} vs independent {b:.1f} (-{100 * (1 - a / b):.0f}%)",
            )
        )
    result["trees"] = trees

    width = max(len(r[0]) for r in rows)
    print(f"{'case':<{width}}  {'time':>12}  note")
    print("-" * (width + 16 + max(len(r[2]) for r in rows)))
    for case, sec_s, note in rows:
        print(f"{case:<{width}}  {sec_s:>12}  {note}")
    print(json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
