"""kvstate.semantic — SEKV, the resolution-adaptive semantic KV cache.

From "SEKV: Resolution-Adaptive Semantic KV Cache with Hierarchical Semantic Memory" (``docs/techniques.md#resolution``):
entropy-guided spans (:mod:`~kvstate.semantic.segment`, pure), a low-rank slow tier
(:mod:`~kvstate.semantic.lowrank`, ranks allocated under a byte budget by :mod:`~kvstate.semantic.ranks`, pure), learned routing / zoom-in (:mod:`~kvstate.semantic.router`), the
two-tier span store with mixed-resolution attention (:mod:`~kvstate.semantic.store`,
:mod:`~kvstate.semantic.attention`) and the ``Cache`` subclass (:mod:`~kvstate.semantic.cache`), configured by
:mod:`~kvstate.semantic.config`; bytes held and read are counted by :mod:`~kvstate.semantic.accounting`.
"""

from kvstate.semantic.accounting import ByteCounts
from kvstate.semantic.attention import SEKV, register, semantic_attention
from kvstate.semantic.cache import (
    SemanticCache,
    SemanticConfig,
    SemanticLayer,
    prefill_and_compress,
    surprisal,
)
from kvstate.semantic.router import RouterConfig, RouterMismatchError, SemanticRouter
from kvstate.semantic.segment import Segmentation, SegmentConfig, fit_budget, segment

__all__ = [
    "SEKV",
    "ByteCounts",
    "RouterConfig",
    "RouterMismatchError",
    "SegmentConfig",
    "Segmentation",
    "SemanticCache",
    "SemanticConfig",
    "SemanticLayer",
    "SemanticRouter",
    "fit_budget",
    "prefill_and_compress",
    "register",
    "segment",
    "semantic_attention",
    "surprisal",
]
