"""Work saved per method on the seeded workloads: the exact DP is never below a baseline."""

from __future__ import annotations

import pytest

from kvstate.lab.prefix.evaluate import match_block, saved_fraction, savings_table, workload_weights
from kvstate.lab.workloads.traces import WORKLOADS
from kvstate.prefix.placement import plan_checkpoints


@pytest.mark.parametrize("workload", WORKLOADS)
def test_optimal_dominates_every_baseline_at_every_budget(workload):
    w = workload_weights(workload, n_requests=120, seed=1, scale=0.1)
    rows = savings_table(w, workload, [1, 2, 4, 8], align=8)
    for m in (1, 2, 4, 8):
        at = {r.method: r.saved_fraction for r in rows if r.slots == m}
        assert all(at["optimal"] >= v - 1e-12 for v in at.values()), at
        assert min(at.values()) >= 0.0 and max(at.values()) <= 1.0


def test_match_block_reaches_block_savings_with_fewer_checkpoints():
    w = workload_weights("quality", n_requests=200, seed=0, scale=0.25)
    n_block, n_opt, target = match_block(w, 64, 64)
    assert n_opt <= n_block
    assert saved_fraction(w, plan_checkpoints(w, n_opt, "optimal", 64)) >= target - 1e-12
    if n_opt > 1:  # and one fewer would not do
        assert saved_fraction(w, plan_checkpoints(w, n_opt - 1, "optimal", 64)) < target - 1e-12


def test_engine_timing_is_well_formed():
    from kvstate.lab.prefix.timing import measure_engine
    from kvstate.models import tiny_model

    t = measure_engine(tiny_model("qwen3_5"), n=256, align=64, slots=2, repeats=1)
    assert t.depths[0] == 0 and all(c % 64 == 0 for c in t.depths[1:])
    assert len(t.resume_s) == len(t.restore_s) == len(t.depths) and min(t.resume_s) > 0
    assert t.capture_ratio > 0
