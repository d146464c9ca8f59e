"""Intervals and decisions for every number the lab reports: the measurement protocol's statistics.

One implementation used by every axis's bench and by the report (``docs/lab.md``):

- a rate of 0/1 outcomes gets a Wilson score interval (SciPy's ``binomtest(...).proportion_ci``);
- a mean of scores in [0, 1] that are not all 0/1 (partial credit) gets a bootstrap interval of the mean;
- perplexity over texts gets a bootstrap interval of ``exp(sum NLL / sum tokens)``, resampling texts;
- two methods scored on the same items get a *paired* bootstrap interval of the mean difference;
- two models' perplexities on the same texts get a *paired* bootstrap interval of their ratio minus one;
- a target is ``met`` when the whole interval is on its good side, ``missed`` when the whole interval is
  on its bad side, and ``undecided`` when the interval straddles it.

Bootstrap resamples come from a seeded ``numpy.random.Generator`` so a report is reproducible. Ignored:
multiple-comparison corrections (each headline row is its own pre-registered target).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
from scipy import stats

from kvstate.errors import KVStateError

CONFIDENCE = 0.95
RESAMPLES = 2000
Status = Literal["met", "missed", "undecided"]


@dataclass(frozen=True)
class Estimate:
    value: float  # the point estimate (mean rate, perplexity, mean difference)
    lo: float  # lower end of the CONFIDENCE interval
    hi: float  # upper end
    n: int  # items (or texts) it rests on

    @property
    def ci(self) -> list[float]:
        return [self.lo, self.hi]


def _array(values: Sequence[float] | np.ndarray, what: str) -> np.ndarray:
    a = np.asarray(values, dtype=np.float64)
    if a.ndim != 1 or a.size == 0:
        raise KVStateError(f"{what}: need a non-empty 1-D list of values, got shape {a.shape}")
    if not np.all(np.isfinite(a)):
        raise KVStateError(f"{what}: values must be finite (a NaN or inf reached the statistics)")
    return a


def wilson(successes: int, n: int, confidence: float = CONFIDENCE) -> Estimate:
    """Wilson score interval of a binomial rate ``successes / n``."""
    if n < 1 or not 0 <= successes <= n:
        raise KVStateError(f"wilson: need 0 <= successes ({successes}) <= n ({n}) and n >= 1")
    ci = stats.binomtest(int(successes), int(n)).proportion_ci(confidence_level=confidence, method="wilson")
    return Estimate(successes / n, float(ci.low), float(ci.high), n)


def _bootstrap(data: tuple[np.ndarray, ...], statistic: object, *, paired: bool, seed: int,
               confidence: float) -> tuple[float, float]:
    if data[0].size < 2 or all(np.all(d == d[0]) for d in data):  # no spread to resample
        v = float(statistic(*data))  # type: ignore[operator]
        return v, v
    res = stats.bootstrap(data, statistic, paired=paired, vectorized=False, n_resamples=RESAMPLES,
                          confidence_level=confidence, method="percentile", rng=np.random.default_rng(seed))
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def rate(scores: Sequence[float] | np.ndarray, *, seed: int = 0, confidence: float = CONFIDENCE) -> Estimate:
    """Mean of per-item scores in [0, 1]: Wilson when every score is 0 or 1, else a bootstrap of the mean."""
    a = _array(scores, "rate")
    if np.any((a < 0) | (a > 1)):
        raise KVStateError("rate: scores must lie in [0, 1]")
    if np.all((a == 0) | (a == 1)):
        return wilson(int(a.sum()), a.size, confidence)
    lo, hi = _bootstrap((a,), np.mean, paired=False, seed=seed, confidence=confidence)
    return Estimate(float(a.mean()), lo, hi, a.size)


def perplexity(nll_sums: Sequence[float] | np.ndarray, token_counts: Sequence[float] | np.ndarray, *,
               seed: int = 0, confidence: float = CONFIDENCE) -> Estimate:
    """``exp(sum NLL / sum tokens)`` over texts, with a bootstrap interval resampling whole texts."""
    nll = _array(nll_sums, "perplexity NLL sums")
    tok = _array(token_counts, "perplexity token counts")
    if nll.size != tok.size or np.any(tok <= 0):
        raise KVStateError("perplexity: one positive token count per text's NLL sum")

    def ppl(x: np.ndarray, t: np.ndarray) -> float:
        return float(np.exp(x.sum() / t.sum()))

    lo, hi = _bootstrap((nll, tok), ppl, paired=True, seed=seed, confidence=confidence)
    return Estimate(ppl(nll, tok), lo, hi, nll.size)


def paired_difference(a: Sequence[float] | np.ndarray, b: Sequence[float] | np.ndarray, *, seed: int = 0,
                      confidence: float = CONFIDENCE) -> Estimate:
    """Mean of ``a - b`` over the same items, with a paired bootstrap interval."""
    x = _array(a, "paired difference (a)")
    y = _array(b, "paired difference (b)")
    if x.size != y.size:
        raise KVStateError(f"paired difference: both methods must be scored on the same items ({x.size} vs {y.size})")

    def diff(u: np.ndarray, v: np.ndarray) -> float:
        return float(np.mean(u - v))

    lo, hi = _bootstrap((x, y), diff, paired=True, seed=seed, confidence=confidence)
    return Estimate(diff(x, y), lo, hi, x.size)


def paired_perplexity_ratio(nll_a: Sequence[float] | np.ndarray, tokens_a: Sequence[float] | np.ndarray,
                            nll_b: Sequence[float] | np.ndarray, tokens_b: Sequence[float] | np.ndarray, *,
                            seed: int = 0, confidence: float = CONFIDENCE) -> Estimate:
    """``ppl(a) / ppl(b) - 1`` over the same texts, with a paired bootstrap interval (whole texts resampled).

    ``+0.02`` means ``a``'s perplexity is 2% above ``b``'s. The texts must be the same (equal token counts).
    """
    xa, ta = _array(nll_a, "paired perplexity (a NLL)"), _array(tokens_a, "paired perplexity (a tokens)")
    xb, tb = _array(nll_b, "paired perplexity (b NLL)"), _array(tokens_b, "paired perplexity (b tokens)")
    if not xa.size == ta.size == xb.size == tb.size or np.any(ta <= 0) or not np.array_equal(ta, tb):
        raise KVStateError("paired perplexity: both models need one NLL sum per text on the same texts "
                           f"(equal positive token counts; got {xa.size} and {xb.size} texts)")

    def ratio(u: np.ndarray, v: np.ndarray, t: np.ndarray) -> float:
        return float(np.exp((u.sum() - v.sum()) / t.sum()) - 1)

    lo, hi = _bootstrap((xa, xb, ta), ratio, paired=True, seed=seed, confidence=confidence)
    return Estimate(ratio(xa, xb, ta), lo, hi, xa.size)


def decide(lo: float, hi: float, threshold: float, *, higher_is_better: bool = True) -> Status:
    """``met`` / ``missed`` / ``undecided`` for a target ``value >= threshold`` (or ``<=``) given an interval."""
    if lo > hi:
        raise KVStateError(f"decide: interval [{lo}, {hi}] is reversed")
    good_lo, good_hi = (lo >= threshold, hi < threshold) if higher_is_better else (hi <= threshold, lo > threshold)
    if good_lo:
        return "met"
    if good_hi:
        return "missed"
    return "undecided"


def items_for_halfwidth(halfwidth: float = 0.1, p: float = 0.5, confidence: float = CONFIDENCE) -> int:
    """Items a rate near ``p`` needs for a normal-approximation interval of ``± halfwidth`` (0.1 → 97)."""
    if not 0 < halfwidth < 1 or not 0 <= p <= 1:
        raise KVStateError("items_for_halfwidth: need 0 < halfwidth < 1 and 0 <= p <= 1")
    z = float(stats.norm.ppf(0.5 + confidence / 2))
    return int(np.ceil(z * z * p * (1 - p) / halfwidth**2))


__all__ = ["CONFIDENCE", "Estimate", "Status", "decide", "items_for_halfwidth", "paired_difference", "perplexity",
           "rate", "wilson"]
