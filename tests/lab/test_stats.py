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
