"""Entropy-guided segmentation against a written-out reference and brute force."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstate.semantic.segment import (
    SegmentConfig,
    fast_bytes,
    fit_budget,
    min_fast_bytes,
    segment,
    span_weights,
)


def reference(s, cfg, k):
    """Written out: forced anchors, top-k surprisal (ties to earlier), then runs via groupby."""
    n = len(s)
    forced = {i for i in range(n) if i < cfg.sinks or i >= n - cfg.recent}
    free = sorted((i for i in range(n) if i not in forced), key=lambda i: (-s[i], i))
    anchors = forced | set(free[:k])
    spans = []
    pos = 0
    for is_anchor, grp in itertools.groupby(range(n), key=lambda i: i in anchors):
        run = list(grp)
        if not is_anchor:
            if len(run) < cfg.min_span:
                anchors |= set(run)
            else:
                pieces = -(-len(run) // cfg.max_span)
                cuts = [run[0] + len(run) * j // pieces for j in range(pieces + 1)]
                spans += list(itertools.pairwise(cuts))
        pos += len(run)
    return sorted(anchors), spans


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=60), st.integers(0, 4), st.integers(0, 6),
       st.integers(1, 4), st.integers(0, 5), st.integers(0, 30))
def test_segment_matches_reference(vals, sinks, recent, min_span, extra, k):
    cfg = SegmentConfig(sinks=sinks, recent=recent, min_span=min_span, max_span=2 * min_span - 1 + extra)
    s = np.array(vals, dtype=float)
    seg = segment(s, cfg, n_anchors=k)
    anchors, spans = reference(list(s), cfg, k)
    assert seg.anchors.tolist() == anchors
    assert [tuple(x) for x in seg.spans.tolist()] == spans
    covered = sorted(seg.anchors.tolist() + [t for a, b in spans for t in range(a, b)])
    assert covered == list(range(len(s)))
    assert all(cfg.min_span <= b - a <= cfg.max_span for a, b in spans)


def test_span_limits_that_cannot_split_every_run_are_refused():
    # a run of 3 tokens cannot be cut into spans of exactly 2: found by hypothesis (vals=[0,0,0], min=max=2)
    with pytest.raises(ValueError, match="2 \\* min_span - 1"):
        SegmentConfig(min_span=2, max_span=2)
    cfg = SegmentConfig(sinks=0, recent=0, min_span=2, max_span=3)
    seg = segment(np.zeros(3), cfg, n_anchors=0)
    assert seg.spans.tolist() == [[0, 3]] and seg.anchors.tolist() == []


def test_threshold_and_fraction_modes():
    s = np.array([0, 1, 9, 1, 1, 1, 8, 1, 1, 1, 1, 0.5])
    by_thr = segment(s, SegmentConfig(sinks=1, recent=1, min_span=1, max_span=8, threshold=5.0))
    assert by_thr.anchors.tolist() == [0, 2, 6, 11]
    assert by_thr.spans.tolist() == [[1, 2], [3, 6], [7, 11]]
    by_frac = segment(s, SegmentConfig(sinks=1, recent=1, min_span=1, max_span=8, anchor_fraction=0.1))
    assert by_frac.anchors.tolist() == [0, 2, 11]  # floor(0.1 * 10) = 1 anchor: the top one


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(0, 10), min_size=8, max_size=80), st.integers(1, 40), st.integers(2, 9))
def test_fit_budget_is_largest_fitting_prefix(vals, budget_tokens, span_cost):
    cfg = SegmentConfig(sinks=2, recent=3, min_span=2, max_span=6)
    s = np.array(vals)
    tb, sb = 10, span_cost
    budget = budget_tokens * tb
    if min_fast_bytes(len(s), cfg, tb, sb) > budget:
        with pytest.raises(ValueError, match="minimum is"):
            fit_budget(s, cfg, budget, tb, sb)
        return
    seg = fit_budget(s, cfg, budget, tb, sb)
    assert fast_bytes(seg, tb, sb) <= budget
    n_free = len(s) - 5
    ks = [k for k in range(n_free + 1) if segment(s, cfg, n_anchors=k).anchors.tolist() == seg.anchors.tolist()]
    k = max(ks)
    assert k == n_free or fast_bytes(segment(s, cfg, n_anchors=k + 1), tb, sb) > budget


def test_budget_error_names_minimum():
    cfg = SegmentConfig(sinks=4, recent=8, max_span=16)
    need = min_fast_bytes(100, cfg, 100, 30)
    assert need == 12 * 100 + 6 * 30  # 88 middle tokens -> 6 spans of <= 16
    with pytest.raises(ValueError, match=f"minimum is {need} bytes"):
        fit_budget(np.zeros(100), cfg, need - 1, 100, 30)


@pytest.mark.parametrize("kw", [{"sinks": -1}, {"recent": 1.5}, {"min_span": 0}, {"min_span": 4, "max_span": 3},
                                {"anchor_fraction": 1.5}, {"threshold": -1.0},
                                {"threshold": 1.0, "anchor_fraction": 0.1}])
def test_config_out_of_range(kw):
    with pytest.raises(ValueError, match="SegmentConfig"):
        SegmentConfig(**kw)


def test_bad_surprisal_and_weights():
    with pytest.raises(ValueError, match="NaN or inf"):
        segment(np.array([0.0, np.nan]), SegmentConfig())
    seg = segment(np.array([0, 3, 1, 0, 2, 2, 0.0]), SegmentConfig(sinks=1, recent=1, min_span=2, max_span=8))
    w = span_weights(np.array([0, 3, 1, 0, 2, 2, 0.0]), seg)
    assert all(abs(x.sum() - 1) < 1e-12 for x in w)
    assert w[0][0] > w[0][1]  # the higher-surprisal token weighs more
