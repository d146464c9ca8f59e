"""Intervals and decisions for every number the lab reports: the measurement protocol's statistics.

One implementation used by every axis's bench and by the report (``docs/lab.md``):

- a rate of 0/1 outcomes gets a Wilson score interval (SciPy's ``binomtest(...).proportion_ci``);
- a mean of scores in [0, 1] that are not all 0/1 (partial credit) gets a bootstrap interval of the mean;
- perplexity over texts gets a bootstrap interval of ``exp(sum NLL / sum tokens)``, resampling texts;
- two methods scored on the same items get a *paired* bootstrap interval of the mean difference;
- two models' perplexities on the same texts get a *paired* bootstrap interval of their ratio minus one;
- a sample with no spread still gets an honest width: scores in [0, 1] get a Wilson interval (exact for
  0/1 outcomes, conservative for partial credit), see :func:`_no_spread_rate`;
- a timing is a median of at least ``MIN_REPEATS`` interleaved repeats with its spread (:func:`timing`,
  :func:`timing_row`); fewer repeats, or a row without a spread, is refused;
- a target is ``met`` when the whole interval is on its good side, ``missed`` when the whole interval is
  on its bad side, and ``undecided`` when the interval straddles it or has no width (a sample that showed
  no spread and whose values nothing bounds cannot decide anything);
- a property that holds by construction (a cap, a constant) is a :class:`Check`: shown apart from the
  results and never counted as a met target (:func:`tally`).

Bootstrap resamples come from a seeded ``numpy.random.Generator`` so a report is reproducible. Ignored:
multiple-comparison corrections (each headline row is its own pre-registered target).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

import numpy as np
from scipy import stats

from kvstate.errors import KVStateError

CONFIDENCE = 0.95
RESAMPLES = 2000
MIN_REPEATS = 5  # interleaved repeats a timing target needs
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
               confidence: float) -> tuple[float, float] | None:
    """Percentile bootstrap interval of ``statistic``, or ``None`` when the sample has no spread to resample."""
    if data[0].size < 2 or all(np.all(d == d[0]) for d in data):
        return None
    res = stats.bootstrap(data, statistic, paired=paired, vectorized=False, n_resamples=RESAMPLES,
                          confidence_level=confidence, method="percentile", rng=np.random.default_rng(seed))
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def _wilson_bounds(mean: float, n: int, confidence: float) -> tuple[float, float]:
    """Wilson score interval for a mean ``mean`` of ``n`` values in [0, 1] (closed form; successes may be fractional)."""
    z = float(stats.norm.ppf(0.5 + confidence / 2))
    denom = 1 + z * z / n
    centre = (mean + z * z / (2 * n)) / denom
    half = z * np.sqrt(mean * (1 - mean) / n + z * z / (4 * n * n)) / denom
    return max(0.0, float(centre - half)), min(1.0, float(centre + half))


def _no_spread_rate(mean: float, n: int, confidence: float) -> tuple[float, float]:
    # A constant sample of scores in [0, 1] that are not all 0/1 (every item 0.5, say): a bootstrap has
    # nothing to resample and a t-interval has zero width too, yet n items cannot pin a mean exactly.
    # Wilson with n * mean fractional successes is conservative: a [0, 1] variable of mean p has variance
    # at most p (1 - p), the Bernoulli variance Wilson assumes. (For 0/1 scores it is exactly Wilson.)
    return _wilson_bounds(mean, n, confidence)


def _no_spread_paired(x: np.ndarray, y: np.ndarray, confidence: float) -> tuple[float, float] | None:
    """Interval of a constant paired difference of scores in [0, 1]; ``None`` when the scores are unbounded."""
    if np.any((x < 0) | (x > 1) | (y < 0) | (y > 1)):
        return None  # nothing bounds the values: no honest width (decide() calls a zero-width interval undecided)
    n, d = x.size, float(np.mean(x - y))
    if np.all((x == 0) | (x == 1)) and np.all((y == 0) | (y == 1)):
        # 0/1 outcomes with one difference on every item: all pairs concordant (d = 0), or all (1, 0) / (0, 1)
        # (d = +-1). The difference is the rate of (1, 0) pairs minus that of (0, 1) pairs, each bounded by
        # the Wilson interval of the discordant count actually seen (0 or n of n).
        if d == 0:
            u = _wilson_bounds(0.0, n, confidence)[1]
            return -u, u
        lo = _wilson_bounds(1.0, n, confidence)[0]
        return (lo, 1.0) if d > 0 else (-1.0, -lo)
    # partial credit: a difference of [0, 1] scores lies in [-1, 1]; the conservative Wilson bound of
    # _no_spread_rate on (d + 1) / 2, mapped back
    lo, hi = _no_spread_rate((d + 1) / 2, n, confidence)
    return 2 * lo - 1, 2 * hi - 1


def rate(scores: Sequence[float] | np.ndarray, *, seed: int = 0, confidence: float = CONFIDENCE) -> Estimate:
    """Mean of per-item scores in [0, 1]: Wilson when every score is 0 or 1, else a bootstrap of the mean."""
    a = _array(scores, "rate")
    if np.any((a < 0) | (a > 1)):
        raise KVStateError("rate: scores must lie in [0, 1]")
    if np.all((a == 0) | (a == 1)):
        return wilson(int(a.sum()), a.size, confidence)
    ci = _bootstrap((a,), np.mean, paired=False, seed=seed, confidence=confidence)
    lo, hi = ci if ci is not None else _no_spread_rate(float(a.mean()), a.size, confidence)
    return Estimate(float(a.mean()), lo, hi, a.size)


def perplexity(nll_sums: Sequence[float] | np.ndarray, token_counts: Sequence[float] | np.ndarray, *,
               seed: int = 0, confidence: float = CONFIDENCE) -> Estimate:
    """``exp(sum NLL / sum tokens)`` over texts, with a bootstrap interval resampling whole texts.

    Texts that all have the same NLL and length give a zero-width interval (nothing bounds a perplexity), which
    :func:`decide` calls undecided.
    """
    nll = _array(nll_sums, "perplexity NLL sums")
    tok = _array(token_counts, "perplexity token counts")
    if nll.size != tok.size or np.any(tok <= 0):
        raise KVStateError("perplexity: one positive token count per text's NLL sum")

    def ppl(x: np.ndarray, t: np.ndarray) -> float:
        return float(np.exp(x.sum() / t.sum()))

    value = ppl(nll, tok)
    lo, hi = _bootstrap((nll, tok), ppl, paired=True, seed=seed, confidence=confidence) or (value, value)
    return Estimate(value, lo, hi, nll.size)


def paired_difference(a: Sequence[float] | np.ndarray, b: Sequence[float] | np.ndarray, *, seed: int = 0,
                      confidence: float = CONFIDENCE) -> Estimate:
    """Mean of ``a - b`` over the same items, with a paired bootstrap interval.

    When every item has the same difference there is nothing to resample: scores in [0, 1] then get a Wilson
    width (:func:`_no_spread_paired`); unbounded values get a zero-width interval, which :func:`decide` calls
    undecided.
    """
    x = _array(a, "paired difference (a)")
    y = _array(b, "paired difference (b)")
    if x.size != y.size:
        raise KVStateError(f"paired difference: both methods must be scored on the same items ({x.size} vs {y.size})")

    def diff(u: np.ndarray, v: np.ndarray) -> float:
        return float(np.mean(u - v))

    value = diff(x, y)
    d = x - y
    if x.size < 2 or np.all(np.abs(d - d[0]) <= 1e-12):  # the same difference on every item (up to rounding)
        ci = _no_spread_paired(x, y, confidence)
    else:
        ci = _bootstrap((x, y), diff, paired=True, seed=seed, confidence=confidence)
    lo, hi = ci or (value, value)
    return Estimate(value, lo, hi, x.size)


def paired_perplexity_ratio(nll_a: Sequence[float] | np.ndarray, tokens_a: Sequence[float] | np.ndarray,
                            nll_b: Sequence[float] | np.ndarray, tokens_b: Sequence[float] | np.ndarray, *,
                            seed: int = 0, confidence: float = CONFIDENCE) -> Estimate:
    """``ppl(a) / ppl(b) - 1`` over the same texts, with a paired bootstrap interval (whole texts resampled).

    ``+0.02`` means ``a``'s perplexity is 2% above ``b``'s. The texts must be the same (equal token counts).
    Texts without any spread give a zero-width interval, which :func:`decide` calls undecided.
    """
    xa, ta = _array(nll_a, "paired perplexity (a NLL)"), _array(tokens_a, "paired perplexity (a tokens)")
    xb, tb = _array(nll_b, "paired perplexity (b NLL)"), _array(tokens_b, "paired perplexity (b tokens)")
    if not xa.size == ta.size == xb.size == tb.size or np.any(ta <= 0) or not np.array_equal(ta, tb):
        raise KVStateError("paired perplexity: both models need one NLL sum per text on the same texts "
                           f"(equal positive token counts; got {xa.size} and {xb.size} texts)")

    def ratio(u: np.ndarray, v: np.ndarray, t: np.ndarray) -> float:
        return float(np.exp((u.sum() - v.sum()) / t.sum()) - 1)

    value = ratio(xa, xb, ta)
    lo, hi = _bootstrap((xa, xb, ta), ratio, paired=True, seed=seed, confidence=confidence) or (value, value)
    return Estimate(value, lo, hi, xa.size)


def decide(lo: float, hi: float, threshold: float, *, higher_is_better: bool = True) -> Status:
    """``met`` / ``missed`` / ``undecided`` for a target ``value >= threshold`` (or ``<=``) given an interval.

    An interval that straddles the threshold is undecided, never met. So is a zero-width interval: every
    estimate here has width unless its sample showed no spread and nothing bounds its values (see
    :func:`perplexity`), and such a sample cannot decide a target. An exact property (a cap, a constant) is
    a :class:`Check`, not a target.
    """
    if lo > hi:
        raise KVStateError(f"decide: interval [{lo}, {hi}] is reversed")
    if lo == hi:
        return "undecided"
    good_lo, good_hi = (lo >= threshold, hi < threshold) if higher_is_better else (hi <= threshold, lo > threshold)
    if good_lo:
        return "met"
    if good_hi:
        return "missed"
    return "undecided"


def _median_interval(a: np.ndarray, confidence: float) -> tuple[float, float]:
    """Distribution-free interval of the median from order statistics (the range when too few repeats)."""
    s = np.sort(a)
    n = s.size
    k = 0  # s[k], s[n-1-k] covers the median with probability 1 - 2 P(Binomial(n, 1/2) <= k)
    while k + 1 < n - 1 - (k + 1) and 1 - 2 * stats.binom.cdf(k + 1, n, 0.5) >= confidence:
        k += 1
    return float(s[k]), float(s[n - 1 - k])


def timing(repeats: Sequence[float] | np.ndarray, *, what: str = "timing",
           confidence: float = CONFIDENCE) -> Estimate:
    """Median of interleaved repeats with its interval, for a timing target.

    The interval is the order-statistic interval of the median (distribution-free): the widest pair of order
    statistics whose coverage is at least ``confidence``, or the range when the repeats are too few for that
    (5 repeats: the range covers the median with probability 1 - 2 / 2**5 ~ 0.94). Refuses fewer than
    ``MIN_REPEATS`` repeats and repeats that are all equal (no spread: one measurement copied).
    """
    a = _array(repeats, what)
    if a.size < MIN_REPEATS:
        raise KVStateError(f"{what}: {a.size} repeat(s); a timing target needs >= {MIN_REPEATS} interleaved repeats "
                           f"with their spread — rerun with --repeats {MIN_REPEATS} or more")
    if np.all(a == a[0]):
        raise KVStateError(f"{what}: all {a.size} repeats are equal ({a[0]}), no spread; record each repeat's own "
                           "measurement")
    lo, hi = _median_interval(a, confidence)
    return Estimate(float(np.median(a)), lo, hi, a.size)


def timing_row(median: float, spread: Sequence[float] | None, repeats: int | None, *,
               what: str = "timing") -> Estimate:
    """A timing read from a result row (median, ``[lo, hi]`` spread of the repeats, repeats) as an estimate.

    Refuses a row with fewer than ``MIN_REPEATS`` repeats (or none recorded), or without a spread that holds
    its median: such a row cannot decide a timing target. The spread is the interval :func:`decide` uses.
    """
    if repeats is None or int(repeats) < MIN_REPEATS:
        raise KVStateError(f"{what}: {repeats or 'no'} repeats recorded; a timing target needs >= {MIN_REPEATS} "
                           f"interleaved repeats with their spread — rerun with --repeats {MIN_REPEATS} or more")
    if spread is None or len(spread) != 2:
        raise KVStateError(f"{what}: no spread recorded (a point value only); a timing target needs the range of its "
                           f"{repeats} repeats — rerun the benchmark that records it")
    lo, hi = float(spread[0]), float(spread[1])
    if not lo <= median <= hi or lo == hi:
        raise KVStateError(f"{what}: spread [{lo}, {hi}] does not hold its median {median} with a width; record the "
                           "repeats' range")
    return Estimate(float(median), lo, hi, int(repeats))


@dataclass(frozen=True)
class Check:
    """A property that holds by construction (a cap, a constant): it verifies the code, it is not a result.

    Shown apart from the results; never counted as a met target (:func:`tally`). A check that fails is a bug
    to fix, not a missed target.
    """

    claim: str  # what holds, e.g. "reads <= budget"
    holds: bool  # whether this run kept it
    because: str  # what it follows from, e.g. "the reader caps reads at the budget"

    kind: ClassVar[str] = "check"  # the row kind a report reads ("result" rows are decided on intervals)


def tally(rows: Iterable[Status | Check]) -> dict[str, int]:
    """Targets met / missed / undecided; checks are counted apart (``checks``, ``checks_failing``), never as met."""
    counts = {"met": 0, "missed": 0, "undecided": 0, "checks": 0, "checks_failing": 0}
    for row in rows:
        if isinstance(row, Check):
            counts["checks"] += 1
            counts["checks_failing"] += not row.holds
        elif row in ("met", "missed", "undecided"):
            counts[row] += 1
        else:
            raise KVStateError(f"tally: {row!r} is neither a status (met / missed / undecided) nor a Check")
    return counts


def items_for_halfwidth(halfwidth: float = 0.1, p: float = 0.5, confidence: float = CONFIDENCE) -> int:
    """Items a rate near ``p`` needs for a normal-approximation interval of ``± halfwidth`` (0.1 → 97)."""
    if not 0 < halfwidth < 1 or not 0 <= p <= 1:
        raise KVStateError("items_for_halfwidth: need 0 < halfwidth < 1 and 0 <= p <= 1")
    z = float(stats.norm.ppf(0.5 + confidence / 2))
    return int(np.ceil(z * z * p * (1 - p) / halfwidth**2))


__all__ = ["CONFIDENCE", "MIN_REPEATS", "Check", "Estimate", "Status", "decide", "items_for_halfwidth",
           "paired_difference", "perplexity", "rate", "tally", "timing", "timing_row", "wilson"]
