"""``SemanticConfig``: the settings of one SEKV cache — read and memory budgets, routing, the slow tier.

From "SEKV: Resolution-Adaptive Semantic KV Cache with Hierarchical Semantic Memory" (see
``docs/techniques.md#resolution``). Two budgets, both fractions of the full KV of the tokens seen
(``kvstate.semantic.accounting.ByteCounts``):

- ``budget`` caps what stays on the device *and* what one forward pass reads: the fast tier (anchors, span
  summaries, bounds or routing summaries) plus the reconstructed K/V of the expanded spans. At compression
  the fast tier is fitted to ``1 - expand_share`` of it, so the rest is free for expansions;
- ``memory`` caps what is held in every tier: fast tier + the working set of expanded spans (at most the
  rest of ``budget``) + the slow tier, so the slow tier gets ``memory`` x full minus the first two. With
  ``memory=None`` the slow tier is capped by ``slow_budget`` x the spans' raw K/V bytes instead.

Spans are ranked by Quest's upper bound on ``q . k`` over their keys (``routing="bounds"``,
:mod:`kvstate.semantic.bounds`) or by the paper's learned relevance (``"learned"``, the ablation). The slow
tier keeps every span as low-rank factors (``slow="lowrank"``), quantized (``"quant"``, at ``bits``, the
``outliers`` share of spans least alike kept unquantized, :mod:`kvstate.semantic.quant`) or raw.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from kvstate.errors import KVStateError
from kvstate.semantic.quant import BITS
from kvstate.semantic.segment import SegmentConfig
from kvstate.validate import check_bool, check_float, check_int

# the default slow tier: with the fast tier and its reads within budget x full KV, every tier together stays
# within (budget + SLOW_BUDGET) x full KV — 0.5 at 8:1 (budget 0.125) — up to the rank-1 floor of spans folded
# while decoding
SLOW_BUDGET = 0.375

# "routed": spans ranked by ``routing``, expanded within the budget; "similarity": ranked by query . mean key
# (SentenceKV-like); "all": every span, ignoring the budget (the exactness oracle); "none": summaries only;
# "soft": training only
Zoom = Literal["routed", "similarity", "all", "none", "soft"]
# "bounds": Quest's upper bound over each span's keys, every span a candidate; "learned": the router's relevance
# gates (the paper's routing, the ablation: it can rank a needle's span below the budget's cut)
Routing = Literal["bounds", "learned"]
Slow = Literal["lowrank", "quant", "raw"]  # the slow tier: low-rank SVD factors, KIVI-style codes, or raw K/V
# which queries of a multi-token pass (the question fed after compression) rank the spans: "last", the token whose
# output is the next token's logits (as single-token decoding ranks), or "all" (the maximum over every token,
# where words shared by many spans — "the secret code of" before every needle — crowd the asked one out)
RouteQuery = Literal["last", "all"]
ZOOMS = ("routed", "similarity", "all", "none", "soft")
ROUTINGS = ("bounds", "learned")
SLOWS = ("lowrank", "quant", "raw")
MEMORY_MAX = 4.0  # memory above 4x the full KV is a typo, not a setting


@dataclass(frozen=True)
class SemanticConfig:
    # The defaults are the shipped ``sekv`` of the report's headline grid (models/ref-attn-sekv/eval.json: recent 16,
    # spans of at most 32, expand share 0.6, a 4-bit slow tier, expanded spans read alone); tests/lab/test_defaults.py
    budget: float = 0.25  # (fast tier + expanded spans) bytes / full KV bytes of the tokens seen, every step
    segment: SegmentConfig = field(default_factory=lambda: SegmentConfig(recent=16, max_span=32))
    memory: float | None = None  # bytes held in every tier / full KV bytes; None: the slow tier under slow_budget
    zoom: Zoom = "routed"
    routing: Routing = "bounds"  # how zoom="routed" ranks spans
    expand_share: float = 0.6  # share of the budget left free at compression for expanded spans (capped zooms)
    slow_budget: float = SLOW_BUDGET  # slow-tier bytes / raw span K/V bytes (predicted ranks are allocated under it)
    max_rank: int = 32  # a span's predicted rank never exceeds this
    rank: int | None = None  # fixed slow-tier rank, outside the slow budget (>= head_dim: exact); None = allocated
    slow: Slow = "quant"
    bits: int = 4  # slow="quant": bits per key / value element, one of 2, 4, 8, 16 (16: not quantized)
    outliers: float = 0.05  # slow="quant": share of spans with the least alike keys kept unquantized
    slow_tier: bool = True  # False: keep summaries only (static grouping baseline; zoom must be "none")
    sticky: bool = True  # expanded spans stay in a budgeted working set (least relevant evicted when over)
    route_query: RouteQuery = "last"  # queries of a multi-token pass that rank the spans (decode steps: the one)
    # False: unexpanded spans are not attended (Quest's reads); their summary keys / values are not kept, so the fast
    # tier is the anchors and the bounds and the budget left for expansions grows (routing="bounds" only). None (the
    # default): False where that is possible (zoom="routed" with routing="bounds": the shipped sekv), else True
    summaries: bool | None = None

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
        if self.routing not in ROUTINGS:
            raise KVStateError(f"SemanticConfig.routing={self.routing!r} must be one of {', '.join(map(repr, ROUTINGS))}")
        if self.slow not in SLOWS:
            raise KVStateError(f"SemanticConfig.slow={self.slow!r} must be one of {', '.join(map(repr, SLOWS))}")
        if isinstance(self.bits, bool) or self.bits not in BITS:
            raise KVStateError(f"SemanticConfig.bits={self.bits!r} must be one of {', '.join(map(str, BITS))} "
                               "(16: kept unquantized)")
        check_float("SemanticConfig.outliers", self.outliers, 0.0, 1.0, hi_open=True, error=KVStateError,
                    hint=" (share of spans kept unquantized)")
        if self.memory is not None:
            check_float("SemanticConfig.memory", self.memory, 0.0, MEMORY_MAX, lo_open=True, error=KVStateError,
                        hint=" (bytes held in every tier / full KV bytes)")
            if self.memory < self.budget:
                raise KVStateError(f"SemanticConfig.memory={self.memory} is below budget={self.budget}: what one pass "
                                   f"reads is also held; set memory >= {self.budget}")
        if not self.slow_tier and self.zoom != "none":
            raise KVStateError(f"SemanticConfig: slow_tier=False keeps no tokens to zoom into; set zoom='none', not {self.zoom!r}")
        if self.summaries is not None:
            check_bool("SemanticConfig.summaries", self.summaries, error=KVStateError)
        if self.summaries is False and (self.zoom != "routed" or self.routing != "bounds"):
            raise KVStateError(f"SemanticConfig: summaries=False attends expanded spans only, which needs zoom='routed' "
                               f"with routing='bounds' (got zoom={self.zoom!r}, routing={self.routing!r}); set "
                               "summaries=True")
        if self.rank is not None:
            check_int("SemanticConfig.rank", self.rank, 1, 1 << 16, error=KVStateError, hint=" or None (allocated)")

    @property
    def attend_summaries(self) -> bool:
        """Whether each unexpanded span is attended as its summary entry (``summaries``, resolved)."""
        if self.summaries is not None:
            return self.summaries
        return not (self.zoom == "routed" and self.routing == "bounds")

    @property
    def capped(self) -> bool:
        """Whether expansion is capped by the budget (every zoom but the oracle and training)."""
        return self.zoom in ("routed", "similarity")

    @property
    def bounds(self) -> bool:
        """Whether the store keeps per-span key bounds (bounds routing, or the quantizer's key ranges)."""
        return (self.routing == "bounds" and self.zoom == "routed") or self.slow == "quant"

    @property
    def route_summaries(self) -> bool:
        """Whether the store keeps the router's per-span summaries (learned routing, and training)."""
        return (self.routing == "learned" and self.zoom == "routed") or self.zoom == "soft"
