"""The lab's intervals against published / closed-form values."""

import numpy as np
import pytest

from kvstate.errors import KVStateError
from kvstate.lab import stats


@pytest.mark.parametrize(("k", "n", "lo", "hi"), [
    (5, 10, 0.2366, 0.7634),  # Wilson 95%, the textbook example (Newcombe 1998, Table I style)
    (0, 10, 0.0, 0.2775),
    (10, 10, 0.7225, 1.0),
    (81, 263, 0.2553, 0.3662),  # Newcombe 1998 example 81/263
])
def test_wilson_known_values(k, n, lo, hi):
    e = stats.wilson(k, n)
    assert e.value == pytest.approx(k / n) and e.lo == pytest.approx(lo, abs=5e-4) and e.hi == pytest.approx(hi, abs=5e-4)


def test_rate_uses_wilson_for_binary_and_bootstrap_for_partial_credit():
    assert stats.rate([1, 0] * 5).ci == pytest.approx(stats.wilson(5, 10).ci)
    partial = stats.rate([0.5] * 50 + [1.0] * 50, seed=1)
    assert partial.value == pytest.approx(0.75) and 0.69 <= partial.lo < 0.72 and 0.78 < partial.hi <= 0.81


def test_bootstrap_interval_matches_normal_theory_for_a_large_sample():
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 1, 2000)
    e = stats.rate(x, seed=3)
    se = x.std(ddof=1) / np.sqrt(x.size)
    assert e.hi - e.lo == pytest.approx(2 * 1.96 * se, rel=0.1)


def test_perplexity_is_exp_of_token_weighted_nll_and_degenerate_without_spread():
    e = stats.perplexity([2.0, 4.0], [1, 2])
    assert e.value == pytest.approx(np.exp(6 / 3))
    flat = stats.perplexity([3.0] * 5, [3] * 5)
    assert flat.lo == flat.hi == pytest.approx(np.e)


def test_paired_difference_is_tighter_than_unpaired_on_correlated_items():
    rng = np.random.default_rng(0)
    base = rng.uniform(0, 1, 200)
    a, b = base + 0.05, base
    e = stats.paired_difference(a, b)
    assert e.value == pytest.approx(0.05) and e.lo == pytest.approx(0.05) and e.hi == pytest.approx(0.05)
    noisy = stats.paired_difference(base + rng.normal(0.05, 0.01, 200), base, seed=2)
    assert noisy.lo > 0.0 and noisy.hi - noisy.lo < 0.01


def test_decide_by_interval():
    assert stats.decide(0.91, 0.95, 0.9) == "met"
    assert stats.decide(0.85, 0.89, 0.9) == "missed"
    assert stats.decide(0.88, 0.93, 0.9) == "undecided"
    assert stats.decide(1.01, 1.02, 1.03, higher_is_better=False) == "met"
    assert stats.decide(1.04, 1.06, 1.03, higher_is_better=False) == "missed"


def test_items_for_halfwidth_and_bad_input():
    assert stats.items_for_halfwidth(0.1) == 97
    with pytest.raises(KVStateError):
        stats.wilson(11, 10)
    with pytest.raises(KVStateError):
        stats.rate([])
    with pytest.raises(KVStateError):
        stats.rate([0.5, float("nan")])
    with pytest.raises(KVStateError):
        stats.paired_difference([1, 0], [1])


def test_paired_perplexity_ratio_is_exact_and_tighter_than_unpaired():
    rng = np.random.default_rng(3)
    tokens = rng.integers(200, 400, size=200).astype(float)
    nll_b = tokens * rng.uniform(1.5, 3.0, size=200)  # texts differ a lot in difficulty
    nll_a = nll_b + tokens * 0.02 + rng.normal(0, 1.0, size=200)  # a is uniformly ~2% worse per token
    est = stats.paired_perplexity_ratio(nll_a, tokens, nll_b, tokens, seed=0)
    exact = np.exp(nll_a.sum() / tokens.sum()) / np.exp(nll_b.sum() / tokens.sum()) - 1
    assert abs(est.value - exact) < 1e-12 and est.n == 200
    assert est.lo < est.value < est.hi and est.lo > 0.015 and est.hi < 0.025
    pa, pb = stats.perplexity(nll_a, tokens), stats.perplexity(nll_b, tokens)
    assert (est.hi - est.lo) < (pa.hi - pa.lo) / pb.value  # pairing removes the per-text difficulty spread
    with pytest.raises(KVStateError, match="same texts"):
        stats.paired_perplexity_ratio(nll_a, tokens, nll_b, tokens + 1)


def test_a_constant_sample_still_has_an_honest_width():
    ones = stats.rate([1] * 25)  # 0/1: Wilson, so 25 of 25 does not pin the rate at 1
    assert ones.lo == pytest.approx(stats.wilson(25, 25).lo) and ones.lo < 0.9
    assert stats.decide(ones.lo, ones.hi, 0.9) == "undecided"
    half = stats.rate([0.5] * 100)  # partial credit, all equal: the conservative Wilson bound, not [0.5, 0.5]
    assert half.lo < 0.5 < half.hi and half.ci == pytest.approx(stats.wilson(50, 100).ci, abs=1e-9)
    tie = stats.paired_difference([1] * 40, [1] * 40)  # every pair concordant: the discordant rate is bounded
    u = stats.wilson(0, 40).hi
    assert tie.value == 0 and tie.lo == pytest.approx(-u) and tie.hi == pytest.approx(u)
    assert stats.decide(tie.lo, tie.hi, -0.05) == "undecided"  # "no worse than 5 points" is not met by 40 ties
    win = stats.paired_difference([1] * 40, [0] * 40)
    assert win.value == 1 and win.lo == pytest.approx(stats.wilson(40, 40).lo) and win.hi == 1
    assert stats.paired_difference([0] * 40, [1] * 40).ci == pytest.approx([-1, -stats.wilson(40, 40).lo])
    partial = stats.paired_difference([0.6] * 50, [0.5] * 50)
    assert partial.lo < 0.1 < partial.hi and partial.hi - partial.lo > 0.1


def test_a_zero_width_interval_and_a_straddling_one_are_undecided():
    flat = stats.perplexity([3.0] * 5, [3] * 5)  # unbounded values without spread: no width to be had
    assert flat.lo == flat.hi and stats.decide(flat.lo, flat.hi, 10.0, higher_is_better=False) == "undecided"
    assert stats.decide(0.5, 0.5, 0.1) == "undecided"
    assert stats.decide(-0.156, 0.046, 0.0) == "undecided"  # a straddling interval is never met
    assert stats.decide(-0.156, 0.046, 0.0, higher_is_better=False) == "undecided"


def test_a_timing_target_needs_five_repeats_with_a_spread():
    with pytest.raises(KVStateError, match=r"3 repeat.*>= 5"):
        stats.timing([1.0, 1.1, 1.2])
    with pytest.raises(KVStateError, match="no spread"):
        stats.timing([2.0] * 5)
    five = stats.timing([1.0, 1.3, 1.1, 1.2, 1.4])
    assert five.value == pytest.approx(1.2) and five.ci == [1.0, 1.4] and five.n == 5  # the range
    many = stats.timing(np.linspace(1.0, 2.0, 30))
    assert 1.0 < many.lo < many.value < many.hi < 2.0  # order statistics inside the range
    with pytest.raises(KVStateError, match=r"3 repeats"):
        stats.timing_row(1.46, [1.40, 1.54], 3)
    with pytest.raises(KVStateError, match="no spread"):
        stats.timing_row(1.46, None, 5)
    with pytest.raises(KVStateError, match="no repeats"):
        stats.timing_row(1.46, [1.40, 1.54], None)
    row = stats.timing_row(1.46, [1.40, 1.54], 5)  # the median under 1.5x, one repeat over it
    assert stats.decide(row.lo, row.hi, 1.5, higher_is_better=False) == "undecided"


def test_a_check_is_shown_apart_and_never_counted_as_met():
    cap = stats.Check("reads <= budget", True, "the reader caps reads at the budget")
    assert cap.kind == "check"
    assert stats.tally(["met", "undecided", cap, stats.Check("total <= 0.5x", False, "the constants")]) == {
        "met": 1, "missed": 0, "undecided": 1, "checks": 2, "checks_failing": 1}
    with pytest.raises(KVStateError, match="neither"):
        stats.tally(["stale"])
