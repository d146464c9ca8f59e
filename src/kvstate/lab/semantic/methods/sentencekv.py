"""``sentencekv``: a SentenceKV-like sentence-level retrieval baseline, labelled as such.

After "SentenceKV: Efficient LLM Inference via Sentence-Level Semantic KV Caching"
(``docs/techniques.md#resolution``): sentences (cut after ``.``) are packed into spans whose mean keys stay on
the device; the raw sentence K/V is offloaded and the sentences whose mean key scores highest against the
query are read back within the read budget (SEKV's store with ``zoom="similarity"``, ``slow="raw"``).
"""

from __future__ import annotations

import itertools
from typing import Any, ClassVar

import numpy as np

from kvstate.lab.semantic.methods.base import Context, Prefilled, StoreMethod, register
from kvstate.semantic.config import SemanticConfig
from kvstate.semantic.segment import Segmentation, SegmentConfig, forced_mask, spans_from_anchors


def sentence_segmentation(tokenizer: Any, ids: list[int], config: SegmentConfig) -> Segmentation:
    """SentenceKV-like spans: whole sentences (each ending at a ``.`` token) packed in order into spans of at
    most ``max_span`` tokens (a longer sentence split evenly); sinks, recent window and pieces shorter than
    ``min_span`` stay anchors."""
    period = tokenizer.convert_tokens_to_ids(".")
    forced = forced_mask(len(ids), config)
    free = np.flatnonzero(~forced)
    if not len(free):
        return spans_from_anchors(forced, config)
    lo, hi = int(free[0]), int(free[-1]) + 1
    cuts = [lo, *(i + 1 for i in range(lo, hi - 1) if ids[i] == period), hi]
    spans: list[tuple[int, int]] = []
    for a, b in itertools.pairwise(cuts):  # one sentence [a, b)
        if spans and b - spans[-1][0] <= config.max_span and spans[-1][1] == a:
            spans[-1] = (spans[-1][0], b)  # the sentence joins the open span
        else:
            pieces = -(-(b - a) // config.max_span)
            bounds = [a + ((b - a) * i) // pieces for i in range(pieces + 1)]
            spans += list(itertools.pairwise(bounds))
    kept = [(a, b) for a, b in spans if b - a >= config.min_span]
    mask = np.ones(len(ids), dtype=bool)
    for a, b in kept:
        mask[a:b] = False
    return Segmentation(len(ids), np.flatnonzero(mask).astype(np.int64), np.array(kept, dtype=np.int64).reshape(-1, 2))


class SentenceKV(StoreMethod):
    name: ClassVar[str] = "sentencekv"
    about: ClassVar[str] = "SentenceKV-like: sentence spans, mean keys on the device, raw sentences read back by similarity"

    def config(self, budget: float, ctx: Context) -> SemanticConfig:
        return SemanticConfig(budget=budget, segment=ctx.segment, zoom="similarity", slow="raw", sticky=False,
                              expand_share=ctx.expand_share)

    def compress(self, cache: Any, tokenizer: Any, context: list[int], pre: Prefilled) -> None:
        seg = sentence_segmentation(tokenizer, context, cache.config.segment)
        cache.check_fits(seg)
        cache.compress_segmentation(seg, [np.full(b - a, 1.0 / (b - a)) for a, b in seg.spans])

    def expanded(self, cache: Any) -> float | None:
        return float(cache.expanded_fraction())


register(SentenceKV())
