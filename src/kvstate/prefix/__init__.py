"""kvstate.prefix — sparse prefix caching for hybrid and recurrent models ("Sparse Prefix Caching for Hybrid and Recurrent LLM Serving").

- placement (pure): :func:`plan_checkpoints` (exact DP + baselines), :func:`expected_recompute`;
- :class:`OverlapHistogram` (pure): decayed overlap-depth histograms, TV distance, Theorem-3 bound;
- tree placement (pure): one slot budget over a prefix tree (beyond the paper);
- store (pure bookkeeping, one radix tree with shared KV, one transaction per request) +
  :class:`SparsePrefixCache` (torch glue, configured by :class:`PrefixCacheConfig`): dense attention KV +
  sparse recurrent checkpoints under one byte budget, exact resume; :func:`chat_boundaries` (torch glue)
  derives the boundaries a request declares from the model's chat template.
"""

from importlib import import_module
from typing import Any

from kvstate.prefix.config import PrefixCacheConfig
from kvstate.prefix.eviction import Policy
from kvstate.prefix.histogram import OverlapHistogram, regret_bound, total_variation
from kvstate.prefix.placement import METHODS, expected_recompute, plan_checkpoints, plan_quadratic_dp
from kvstate.prefix.store import Hit, PrefixStore, StoreConfig, StoreMetrics, Txn
from kvstate.prefix.tree_placement import (
    PrefixTree,
    TreePoint,
    plan_independent,
    plan_tree,
    tree_expected_recompute,
)

__all__ = [
    "METHODS",
    "Hit",
    "OverlapHistogram",
    "Policy",
    "PrefillResult",
    "PrefixCacheConfig",
    "PrefixStore",
    "PrefixTree",
    "SparsePrefixCache",
    "StoreConfig",
    "StoreMetrics",
    "TreePoint",
    "Txn",
    "chat_boundaries",
    "expected_recompute",
    "plan_checkpoints",
    "plan_independent",
    "plan_quadratic_dp",
    "plan_tree",
    "regret_bound",
    "total_variation",
    "tree_expected_recompute",
]


def __getattr__(name: str) -> Any:
    # torch glue loads on first use, so the pure modules (and ``kvstate plan``) import without torch
    if name in ("PrefillResult", "SparsePrefixCache"):
        return getattr(import_module("kvstate.prefix.engine"), name)
    if name == "chat_boundaries":
        return import_module("kvstate.prefix.chat").chat_boundaries
    raise AttributeError(f"module 'kvstate.prefix' has no attribute {name!r}")
