"""The prefix cache's one configuration (pure): budget, slots, planner, eviction policy, state device.

Sparse prefix caching ("Sparse Prefix Caching for Hybrid and Recurrent LLM Serving"); see
``docs/techniques.md``. Validated on construction with messages naming the field and the allowed range.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstate.errors import BudgetError, KVStateError
from kvstate.prefix.eviction import Policy
from kvstate.prefix.placement import METHODS


@dataclass(frozen=True)
class PrefixCacheConfig:
    budget_bytes: int  # one byte budget over attention KV, recurrent states and stored logits
    slots_per_entry: int = 8  # planned recurrent checkpoints per request path (end states are extra)
    planner: str = "optimal"  # a placement method of kvstate.prefix.placement
    align: int | None = None  # checkpoint grid (None: the model's chunk size)
    policy: str = "lru"  # eviction: "lru" or "utility"
    alpha: float = 1.0  # utility policy weight of recompute FLOPs saved per byte
    block_size: int = 64  # the "block" planner's spacing
    state_device: str | None = None  # keep stored tensors here (e.g. "cpu" for a RAM tier); None: the model's

    def __post_init__(self) -> None:
        if (
            isinstance(self.budget_bytes, bool)
            or not isinstance(self.budget_bytes, int)
            or self.budget_bytes <= 0
        ):
            raise BudgetError(f"budget_bytes={self.budget_bytes!r} must be a positive int (bytes).")
        if self.slots_per_entry < 0:
            raise BudgetError(f"slots_per_entry={self.slots_per_entry} must be >= 0.")
        if self.planner not in METHODS:
            raise KVStateError(f"planner={self.planner!r} is not one of {sorted(METHODS)}.")
        if self.policy not in {p.value for p in Policy}:
            raise KVStateError(f"policy={self.policy!r} is not one of {[p.value for p in Policy]}.")
        if self.align is not None and self.align < 1:
            raise KVStateError(f"align={self.align} must be >= 1 (default: the model's chunk size).")
        if self.alpha < 0:
            raise KVStateError(f"alpha={self.alpha} must be >= 0.")
        if self.block_size < 1:
            raise KVStateError(f"block_size={self.block_size} must be >= 1.")
