"""Property tests: numeric arguments of the planner, the histogram, the prefix cache and the training config.

Any float (NaN, inf, huge, subnormal), any int, or a value of the wrong type gives either a valid result
or the documented error naming the argument — never another exception, and never a non-finite result.
"""

from __future__ import annotations

import math
from dataclasses import fields

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstate.errors import BudgetError, KVStateError
from kvstate.lab.training.train import TrainConfig, TrainError
from kvstate.lab.workloads.traces import Request, overlap_weights
from kvstate.prefix.engine import SparsePrefixCache
from kvstate.prefix.histogram import OverlapHistogram, total_variation
from kvstate.prefix.placement import METHODS, expected_recompute, plan_checkpoints
from tests.conftest import get_model

ANY = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-(2**70), 2**70), st.booleans(),
                st.none(), st.text(max_size=3), st.complex_numbers(max_magnitude=10), st.lists(st.integers(), max_size=2))
SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(weights=st.lists(st.one_of(st.floats(), st.integers(-5, 10**300)), min_size=0, max_size=12),
       slots=ANY, align=ANY, method=st.sampled_from(METHODS))
def test_plan_checkpoints_valid_or_value_error(weights, slots, align, method):
    try:
        positions = plan_checkpoints(weights, slots, method, align)
    except ValueError as exc:
        assert str(exc).split(":")[0] in {"weights", "slots", "align", "method", "block_size"}
        return
    n = len(weights) - 1
    assert all(isinstance(p, int) and 1 <= p <= n for p in positions) and len(positions) <= slots
    cost = expected_recompute(weights, positions)
    assert math.isfinite(cost) and 0.0 <= cost <= n


@pytest.mark.parametrize("weights", [[1e308] * 3, [1e308, 0, 1e308], [5e-324, 0, 5e-324], [10**400, 0, 10**400]])
def test_extreme_but_finite_weights_give_the_true_recompute(weights):
    # uniform mass on {0, 2} or {0, 1, 2}: no checkpoint recomputes the mean depth
    mean = float(np.mean([t for t, w in enumerate(weights) if w]))
    if any(isinstance(w, int) and w > 1e308 for w in weights):
        with pytest.raises(ValueError, match="weights"):
            plan_checkpoints(weights, 1)
        return
    assert expected_recompute(weights, []) == pytest.approx(mean)
    assert expected_recompute(weights, plan_checkpoints(weights, 2)) == 0.0


@pytest.mark.parametrize("weights", [np.array([1 + 1j, 1, 1]), ["1", "2"], [[1, 2], [3]], {"a": 1}, np.array([1, 2], dtype=object)])
def test_weights_of_the_wrong_type(weights):
    with pytest.raises(ValueError, match="weights"):
        plan_checkpoints(weights, 1)


def test_absurd_plans_are_refused_before_allocating():
    with pytest.raises(ValueError, match="GiB"):
        plan_checkpoints(np.ones(2**20), 2**12)


@SETTINGS
@given(n=ANY, gamma=ANY, alpha=ANY, bin_width=ANY, depths=st.lists(st.integers(-3, 40), max_size=5))
def test_overlap_histogram_valid_or_value_error(n, gamma, alpha, bin_width, depths):
    try:
        h = OverlapHistogram(n, gamma=gamma, alpha=alpha, bin_width=bin_width)
    except ValueError as exc:
        assert str(exc).split(":")[0] in {"n", "gamma", "alpha", "bin_width"}
        return
    try:
        h.record_many(depths)
    except ValueError as exc:
        assert str(exc).startswith(("depth", "depths"))
        return
    w = h.weights()
    assert w.shape == (h.n + 1,) and np.all(np.isfinite(w)) and np.all(w >= 0)
    if w.sum() > 0:
        assert math.isfinite(total_variation(w, np.ones(h.n + 1)))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(budget=ANY, slots=ANY, align=ANY, alpha=ANY, block=ANY)
def test_sparse_prefix_cache_valid_or_kvstate_error(budget, slots, align, alpha, block):
    model = get_model("qwen3_5")
    try:
        cache = SparsePrefixCache(model, budget, slots, align=align, alpha=alpha, block_size=block)
    except KVStateError as exc:
        assert any(name in str(exc) for name in ("budget_bytes", "slots_per_entry", "align", "alpha", "block_size"))
        return
    assert cache.store.config.budget_bytes == budget and math.isfinite(cache.store.config.budget_bytes)


@pytest.mark.parametrize("budget", [float("nan"), float("inf"), 1e9, True, -1, 0, "1000"])
def test_sparse_prefix_cache_budget(budget):
    with pytest.raises(BudgetError, match="budget_bytes"):
        SparsePrefixCache(get_model("qwen3_5"), budget)


def test_lookup_refuses_a_batch():
    cache = SparsePrefixCache(get_model("qwen3_5"), 10**8)
    with pytest.raises(KVStateError, match="one non-empty sequence"):
        cache.lookup(torch.zeros(2, 8, dtype=torch.long))
    hit = cache.lookup(torch.zeros(1, 8, dtype=torch.long))
    assert hit.overlap == 0 and hit.position == 0 and not hit.full


NOT_NUMERIC = ("arch", "advance_metric", "task_mix", "bf16", "warmup_per_part")
NUMERIC = [f.name for f in fields(TrainConfig) if f.name not in NOT_NUMERIC]


@SETTINGS
@given(name=st.sampled_from(NUMERIC), value=ANY)
def test_train_config_valid_or_train_error(name, value):
    try:
        cfg = TrainConfig(**{name: value})
    except TrainError as exc:
        assert name in str(exc)
        return
    got = getattr(cfg, name)
    assert got is None or (not isinstance(got, bool) and math.isfinite(got))


@SETTINGS
@given(mix=st.dictionaries(st.sampled_from(["niah_single", "qa", "copy"]), ANY, min_size=1, max_size=3),
       bf16=ANY, metric=ANY)
def test_train_config_other_fields(mix, bf16, metric):
    try:
        TrainConfig(task_mix=mix, bf16=bf16, advance_metric=metric)
    except TrainError:
        return
    assert isinstance(bf16, bool) and metric in ("first_token", "exact")
    assert all(math.isfinite(v) and v >= 0 for v in mix.values())


def test_overlap_weights_refuses_a_length_below_the_deepest_overlap():
    reqs = [Request(None, "a", 7, 9), Request(None, "a", 3, 9)]
    with pytest.raises(ValueError, match="length: 5 is below the deepest overlap 7"):
        overlap_weights(reqs, length=5)
    assert overlap_weights(reqs, length=8).tolist() == [0, 0, 0, 1, 0, 0, 0, 1, 0]
