"""kvstate.depth — cross-layer KV sharing and Random Cross-Layer Attention (Stochastic KV Routing).

Pure patterns live in :mod:`kvstate.depth.patterns`; the torch glue (routed attention, the sharing
cache, stochastic routing) loads lazily on first use, so the pure part runs without torch. Training and
evaluation with routing live in the lab (``kvstate.lab.depth``).
"""

from __future__ import annotations

from typing import Any

from kvstate.depth.patterns import (
    LayerSpec,
    PatternError,
    SharingPattern,
    cla,
    draw_route,
    for_keep,
    format_pattern,
    keep,
    none,
    parse_pattern,
    top_shared,
)

_LAZY = {"apply_sharing": "sharing", "sharing_cache": "sharing", "kv_bytes": "sharing", "layer_specs": "attention",
         "StochasticKVRouting": "routing"}  # training and evaluation live in the lab (kvstate.lab.depth)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"kvstate.depth.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'kvstate.depth' has no attribute {name!r}")


__all__ = ["LayerSpec", "PatternError", "SharingPattern", "StochasticKVRouting", "apply_sharing", "cla", "draw_route",
           "for_keep", "format_pattern", "keep", "kv_bytes", "layer_specs", "none", "parse_pattern", "sharing_cache",
           "top_shared"]
