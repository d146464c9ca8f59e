"""``SemanticConfig``: the settings of one SEKV cache — the read budget, the slow-tier budget, zoom, offload.

From "SEKV: Resolution-Adaptive Semantic KV Cache with Hierarchical Semantic Memory" (see
``docs/techniques.md#resolution``). Two budgets, both fractions:

- ``budget`` caps what stays on the device *and* what one forward pass reads: the fast tier (anchors, span
  summaries, routing summaries) plus the reconstructed K/V of the expanded spans never exceed
  ``budget`` x the full KV of the tokens seen (``kvstate.semantic.accounting.ByteCounts``). At compression
  the fast tier is fitted to ``1 - expand_share`` of it, so the rest is free for expansions;
- ``slow_budget`` caps the slow tier: the low-rank factors of every span take at most that fraction of the
  spans' raw K/V bytes (ranks allocated under it, :mod:`kvstate.semantic.ranks`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from kvstate.errors import KVStateError
from kvstate.semantic.segment import SegmentConfig
from kvstate.validate import check_bool, check_float, check_int

# the default slow tier: with the fast tier and its reads within budget x full KV, every tier together stays
# within (budget + SLOW_BUDGET) x full KV — 0.5 at 8:1 (budget 0.125) — up to the rank-1 floor of spans folded
# while decoding
SLOW_BUDGET = 0.375

# "learned": the router's relevance gates; "similarity": spans ranked by query . mean key (SentenceKV-like);
# "all": every span, ignoring the budget (the exactness oracle); "none": summaries only; "soft": training only
Zoom = Literal["learned", "similarity", "all", "none", "soft"]
Offload = Literal["lowrank", "raw"]  # the slow tier: low-rank SVD factors, or the raw span K/V (ablation)
# which queries of a multi-token pass (the question fed after compression) rank the spans: "last", the token whose
# output is the next token's logits (as single-token decoding ranks), or "all" (the maximum over every token,
# where words shared by many spans — "the secret code of" before every needle — crowd the asked one out)
RouteQuery = Literal["last", "all"]
ZOOMS = ("learned", "similarity", "all", "none", "soft")


@dataclass(frozen=True)
class SemanticConfig:
    budget: float = 0.25  # (fast tier + expanded spans) bytes / full KV bytes of the tokens seen, every step
    segment: SegmentConfig = field(default_factory=SegmentConfig)
    zoom: Zoom = "learned"
    expand_share: float = 0.5  # share of the budget left free at compression for expanded spans (capped zooms)
    slow_budget: float = SLOW_BUDGET  # slow-tier bytes / raw span K/V bytes (predicted ranks are allocated under it)
    max_rank: int = 32  # a span's predicted rank never exceeds this
    rank: int | None = None  # fixed slow-tier rank, outside the slow budget (>= head_dim: exact); None = allocated
    offload: Offload = "lowrank"
    slow_tier: bool = True  # False: keep summaries only (static grouping baseline; zoom must be "none")
    sticky: bool = True  # expanded spans stay in a budgeted working set (least relevant evicted when over)
    route_query: RouteQuery = "last"  # queries of a multi-token pass that rank the spans (decode steps: the one)

    def __post_init__(self) -> None:
        check_float("SemanticConfig.budget", self.budget, 0.0, 1.0, lo_open=True, error=KVStateError,
                    hint=" (fast tier + expanded spans / full KV bytes)")
        check_float("SemanticConfig.expand_share", self.expand_share, 0.0, 1.0, hi_open=True, error=KVStateError,
                    hint=" (share of the budget kept free for expanded spans)")
        check_float("SemanticConfig.slow_budget", self.slow_budget, 0.0, 1.0, lo_open=True, error=KVStateError,
                    hint=" (slow-tier bytes / raw span K/V bytes)")
        check_int("SemanticConfig.max_rank", self.max_rank, 1, 1 << 16, error=KVStateError)
        if not isinstance(self.segment, SegmentConfig):
            raise KVStateError(f"SemanticConfig.segment={self.segment!r} must be a SegmentConfig")
        check_bool("SemanticConfig.slow_tier", self.slow_tier, error=KVStateError)
        check_bool("SemanticConfig.sticky", self.sticky, error=KVStateError)
        if self.zoom not in ZOOMS:
            raise KVStateError(f"SemanticConfig.zoom={self.zoom!r} must be one of {', '.join(map(repr, ZOOMS))} "
                               "('soft': training only)")
        if self.route_query not in ("last", "all"):
            raise KVStateError(f"SemanticConfig.route_query={self.route_query!r} must be 'last' or 'all'")
        if self.offload not in ("lowrank", "raw"):
            raise KVStateError(f"SemanticConfig.offload={self.offload!r} must be 'lowrank' or 'raw'")
        if not self.slow_tier and self.zoom != "none":
            raise KVStateError(f"SemanticConfig: slow_tier=False keeps no tokens to zoom into; set zoom='none', not {self.zoom!r}")
        if self.rank is not None:
            check_int("SemanticConfig.rank", self.rank, 1, 1 << 16, error=KVStateError, hint=" or None (allocated)")

    @property
    def capped(self) -> bool:
        """Whether expansion is capped by the budget (every zoom but the oracle and training)."""
        return self.zoom in ("learned", "similarity")
