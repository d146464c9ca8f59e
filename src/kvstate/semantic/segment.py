"""Entropy-guided span segmentation (pure: NumPy only, no torch).

From "SEKV: Resolution-Adaptive Semantic KV Cache with Hierarchical Semantic Memory" (see
``docs/techniques.md#resolution``): the surprisal ``H_t = -log p(x_t | x_<t)`` of every context token,
free from the prefill logits, marks semantic transitions. The highest-surprisal tokens become *anchors*
(kept at full resolution), together with a few attention-sink tokens at the start and a recent window
at the end; the runs of tokens between anchors become *spans*, each summarised by one vector in the
fast tier. Runs shorter than ``min_span`` are kept as anchors (a summary would cost about as much as
the tokens); runs longer than ``max_span`` are cut into near-equal spans of at most ``max_span``.

Anchors are chosen by a surprisal threshold, a top fraction, or — the default used by the cache — as
many as a fast-tier byte budget allows (:func:`fit_budget`). Ties in surprisal break towards the
earlier position, so a segmentation is a deterministic function of its inputs.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvstate.validate import check_float, check_int

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True)
class SegmentConfig:
    """How a context is cut into anchors and spans."""

    sinks: int = 4  # first tokens always kept (attention sinks)
    recent: int = 32  # last tokens always kept (recent window)
    min_span: int = 2  # runs shorter than this stay anchors
    max_span: int = 32  # longer runs are cut into spans of at most this many tokens
    anchor_fraction: float | None = None  # keep this top fraction of middle tokens as anchors
    threshold: float | None = None  # or: keep tokens with surprisal >= threshold (nats)

    def __post_init__(self) -> None:
        for name in ("sinks", "recent"):
            check_int(f"SegmentConfig.{name}", getattr(self, name), 0, 4096)
        check_int("SegmentConfig.min_span", self.min_span, 1, 1024)
        # max_span >= 2 * min_span - 1: then every run of at least min_span tokens splits evenly into spans of
        # min_span..max_span tokens (a run of 3 with min = max = 2 could not)
        lo = 2 * self.min_span - 1
        check_int("SegmentConfig.max_span", self.max_span, lo, 4096,
                  hint=" (>= 2 * min_span - 1, so that every run splits into spans within [min_span, max_span])")
        if self.anchor_fraction is not None and self.threshold is not None:
            raise ValueError("SegmentConfig: give anchor_fraction or threshold, not both")
        if self.anchor_fraction is not None:
            check_float("SegmentConfig.anchor_fraction", self.anchor_fraction, 0.0, 1.0)
        if self.threshold is not None:
            check_float("SegmentConfig.threshold", self.threshold, 0.0, hint=" (a surprisal in nats)")


@dataclass(frozen=True)
class Segmentation:
    """Anchors and spans of a context of ``length`` tokens; together they cover every position once."""

    length: int
    anchors: IntArray  # (A,) ascending positions kept at full resolution
    spans: IntArray  # (S, 2) [start, end) of each span, ascending, disjoint from anchors

    @property
    def n_span_tokens(self) -> int:
        return int((self.spans[:, 1] - self.spans[:, 0]).sum()) if len(self.spans) else 0


def _check_surprisal(surprisal: FloatArray) -> FloatArray:
    s = np.asarray(surprisal, dtype=np.float64)
    if s.ndim != 1:
        raise ValueError(f"surprisal must be 1-D (one value per token), got shape {s.shape}")
    if not np.all(np.isfinite(s)):
        raise ValueError("surprisal holds NaN or inf; pass -log p(x_t | x_<t) of every token (0 for the first)")
    return s


def forced_mask(length: int, config: SegmentConfig) -> npt.NDArray[np.bool_]:
    """Positions that are anchors whatever the surprisal: the sinks and the recent window."""
    mask = np.zeros(length, dtype=bool)
    mask[: min(config.sinks, length)] = True
    if config.recent:
        mask[max(0, length - config.recent):] = True
    return mask


def surprisal_order(surprisal: FloatArray, forced: npt.NDArray[np.bool_]) -> IntArray:
    """Free positions by descending surprisal, ties to the earlier position."""
    free = np.flatnonzero(~forced)
    order = np.lexsort((free, -surprisal[free]))  # primary key last: surprisal desc, then position asc
    return free[order].astype(np.int64)


def spans_from_anchors(anchor_mask: npt.NDArray[np.bool_], config: SegmentConfig) -> Segmentation:
    """Cut the runs between anchors into spans (short runs become anchors, long runs split evenly)."""
    mask = anchor_mask.copy()
    length = len(mask)
    spans: list[tuple[int, int]] = []
    t = 0
    while t < length:
        if mask[t]:
            t += 1
            continue
        end = t
        while end < length and not mask[end]:
            end += 1
        run = end - t
        if run < config.min_span:
            mask[t:end] = True
        else:
            pieces = -(-run // config.max_span)  # ceil
            bounds = [t + (run * i) // pieces for i in range(pieces + 1)]
            spans.extend(itertools.pairwise(bounds))
        t = end
    arr = np.array(spans, dtype=np.int64).reshape(-1, 2)
    return Segmentation(length, np.flatnonzero(mask).astype(np.int64), arr)


def segment(surprisal: FloatArray, config: SegmentConfig, n_anchors: int | None = None) -> Segmentation:
    """Segment a context by its surprisal.

    Extra anchors (beyond sinks and recent window): the ``n_anchors`` highest-surprisal positions if
    given, else those at or above ``config.threshold``, else the top ``config.anchor_fraction``, else none.
    """
    s = _check_surprisal(surprisal)
    forced = forced_mask(len(s), config)
    order = surprisal_order(s, forced)
    if n_anchors is not None:
        if not n_anchors >= 0:
            raise ValueError(f"n_anchors={n_anchors} must be >= 0")
        chosen = order[:n_anchors]
    elif config.threshold is not None:
        chosen = order[s[order] >= config.threshold]
    elif config.anchor_fraction is not None:
        chosen = order[: int(np.floor(config.anchor_fraction * len(order)))]
    else:
        chosen = order[:0]
    mask = forced.copy()
    mask[chosen] = True
    return spans_from_anchors(mask, config)


def fast_bytes(seg: Segmentation, token_bytes: int, span_bytes: int) -> int:
    """Fast-tier bytes of a segmentation: full K/V per anchor plus one summary per span."""
    return len(seg.anchors) * token_bytes + len(seg.spans) * span_bytes


def min_fast_bytes(length: int, config: SegmentConfig, token_bytes: int, span_bytes: int) -> int:
    """The smallest fast tier any segmentation of ``length`` tokens needs (no surprisal anchors)."""
    return fast_bytes(segment(np.zeros(length), config, n_anchors=0), token_bytes, span_bytes)


def fit_budget(surprisal: FloatArray, config: SegmentConfig, budget_bytes: int, token_bytes: int,
               span_bytes: int) -> Segmentation:
    """The segmentation with the most surprisal anchors whose fast tier fits ``budget_bytes``.

    Raises ``ValueError`` naming the minimum when even zero extra anchors do not fit. Bytes are not
    strictly monotone in the anchor count (an anchor can split a span in two), so the binary search
    keeps the invariant "``lo`` anchors fit" and the result always fits.
    """
    s = _check_surprisal(surprisal)
    if token_bytes <= 0 or span_bytes <= 0:
        raise ValueError(f"token_bytes={token_bytes} and span_bytes={span_bytes} must be > 0")
    base = segment(s, config, n_anchors=0)
    need = fast_bytes(base, token_bytes, span_bytes)
    if need > budget_bytes:
        raise ValueError(f"fast-tier budget of {budget_bytes} bytes cannot hold the sinks, recent window and span "
                         f"summaries of a {len(s)}-token context: the minimum is {need} bytes; raise the budget or "
                         "lower sinks / recent / raise max_span")
    lo, hi = 0, int((~forced_mask(len(s), config)).sum())
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fast_bytes(segment(s, config, n_anchors=mid), token_bytes, span_bytes) <= budget_bytes:
            lo = mid
        else:
            hi = mid - 1
    return segment(s, config, n_anchors=lo)


def span_weights(surprisal: FloatArray, seg: Segmentation) -> list[FloatArray]:
    """Per span, surprisal weights normalised to sum 1 (uniform where a span's surprisal is all zero)."""
    s = _check_surprisal(surprisal)
    out: list[FloatArray] = []
    for a, b in seg.spans:
        w = np.maximum(s[a:b], 0.0) + 1e-6
        out.append(w / w.sum())
    return out
