"""Planners and eviction policies are registered objects: a new one is one registration, an unknown name lists them."""

import numpy as np
import pytest

from kvstate.errors import KVStateError
from kvstate.prefix import eviction, placement
from kvstate.prefix.config import PrefixCacheConfig


def test_an_unknown_planner_or_policy_lists_the_registry():
    with pytest.raises(ValueError, match=r"method: unknown 'nope'; choose one of optimal, balanced, block, log, sqrt, "
                                         r"junction"):
        placement.plan_checkpoints(np.ones(65), 2, "nope")
    with pytest.raises(KVStateError, match=r"planner='nope' is not a registered planner; choose one of optimal, balanced"):
        PrefixCacheConfig(1 << 20, planner="nope")
    with pytest.raises(KVStateError, match=r"policy='mru' is not a registered eviction policy; choose one of lru, utility"):
        PrefixCacheConfig(1 << 20, policy="mru")


def test_a_registered_planner_is_a_choice_everywhere_and_matches_brute_force():
    """A toy planner (the deepest grid points) registered in one call: plan_checkpoints, the config and the
    CLI take it; its expected recompute equals a brute-force count over depths."""
    from typer.testing import CliRunner

    from kvstate.cli import app

    def deepest(w, slots, align, block):
        n = w.size - 1
        return list(range(n // align * align, 0, -align))[:slots][::-1]

    placement.register_planner(placement.Planner("toy-deepest", deepest, False, "the deepest grid points"))
    try:
        w = np.zeros(129)
        w[[10, 70, 128]] = 1
        pos = placement.plan_checkpoints(w, 2, "toy-deepest", 32)
        assert pos == [96, 128]
        brute = sum(w[t] * (t - max([0] + [c for c in pos if c <= t])) for t in range(129)) / w.sum()
        assert placement.expected_recompute(w, pos) == pytest.approx(brute)
        assert PrefixCacheConfig(1 << 20, planner="toy-deepest").planner == "toy-deepest"
        assert "toy-deepest" in placement.planner_names()
        with pytest.raises(ValueError, match="not a new Planner name"):
            placement.register_planner(placement.Planner("optimal", deepest, False, "x"))
    finally:
        placement.unregister_planner("toy-deepest")
    assert "toy-deepest" not in placement.planner_names()
    assert CliRunner().invoke(app, ["plan", "--help"]).exit_code == 0


def test_eviction_policies_dispatch_through_the_registry():
    units = [eviction.Unit(0, None, 10, 5, 1.0), eviction.Unit(1, 4, 10, 1, 0.0), eviction.Unit(2, None, 10, 3, 9.0)]
    assert [u.entry for u in eviction.eviction_order(units, "lru", 1.0)] == [1, 2, 0]
    eviction.register_policy(eviction.EvictionPolicy("toy-biggest-entry", lambda us, f, a: sorted(
        us, key=lambda u: -u.entry), "highest entry id first"))
    try:
        assert [u.entry for u in eviction.eviction_order(units, "toy-biggest-entry", 1.0)] == [2, 1, 0]
        assert PrefixCacheConfig(1 << 20, policy="toy-biggest-entry").policy == "toy-biggest-entry"
    finally:
        eviction.unregister_policy("toy-biggest-entry")
    with pytest.raises(ValueError, match="choose one of lru, utility"):
        eviction.eviction_order(units, "toy-biggest-entry", 1.0)
