"""kvstate.depth — cross-layer KV sharing and Random Cross-Layer Attention (Stochastic KV Routing).

Pure patterns live in :mod:`kvstate.depth.patterns`; the torch glue (routed attention, the sharing
cache, stochastic routing) is imported lazily so the pure part runs without torch.
"""

from kvstate.depth.patterns import (
    LayerSpec,
    PatternError,
    SharingPattern,
    cla,
    for_keep,
    format_pattern,
    keep,
    none,
    parse_pattern,
    top_shared,
)

__all__ = ["LayerSpec", "PatternError", "SharingPattern", "cla", "for_keep", "format_pattern", "keep", "none",
           "parse_pattern", "top_shared"]
