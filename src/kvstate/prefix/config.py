"""The prefix cache's one configuration (pure): budget, slots, planner, placement, eviction policy, state device,
shared tier.

Sparse prefix caching ("Sparse Prefix Caching for Hybrid and Recurrent LLM Serving"); see
``docs/techniques.md``. Validated on construction with messages naming the field and the allowed range.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstate.errors import BudgetError, KVStateError
from kvstate.prefix.eviction import policy_names
from kvstate.prefix.placement import Placement, planner_names
from kvstate.prefix.remote import check_remote_url
from kvstate.validate import check_float, check_int


@dataclass(frozen=True)
class PrefixCacheConfig:
    budget_bytes: int  # one byte budget over attention KV, recurrent states and stored logits
    slots_per_entry: int = 8  # planned recurrent checkpoints per request path (end states are extra)
    planner: str = "optimal"  # a registered planner (kvstate.prefix.placement.PLANNERS)
    align: int | None = None  # checkpoint grid (None: the model's chunk size)
    policy: str = "lru"  # a registered eviction policy (kvstate.prefix.eviction.POLICIES): "lru", "utility"
    alpha: float = 1.0  # utility policy weight of recompute FLOPs saved per byte
    block_size: int = 64  # the "block" planner's spacing
    state_device: str | None = None  # keep stored tensors here (e.g. "cpu" for a RAM tier); None: the model's
    # Placement.PATH: `planner` on each request's path; TREE: exact DP over a bounded subtree ("path" / "tree" accepted)
    placement: Placement = Placement.PATH
    remote: str | None = None  # shared tier for replicas, "redis://host:port/db" (None: this process only)
    remote_retry_s: float = 1.0  # after the shared tier failed, serve local-only this long before retrying
    # a file holding the cluster key that signs the shared tier's entries (None: $KVSTATE_REMOTE_KEY, else unkeyed)
    remote_key_file: str | None = None
    # a checkpoint captured mid-prompt costs an extra forward call: capture only where the tokens it is
    # expected to save (overlap mass it serves × tokens saved) reach this; None: half the checkpoint grid
    capture_min_saving: float | None = None

    def __post_init__(self) -> None:
        # type and range first: a NaN budget never evicts, a True slot count slips through int()
        check_int("budget_bytes", self.budget_bytes, 1, error=BudgetError, hint="; pass the byte budget as an int")
        check_int("slots_per_entry", self.slots_per_entry, 0, 2**20, error=BudgetError)
        if self.planner not in planner_names():
            raise KVStateError(f"planner={self.planner!r} is not a registered planner; choose one of "
                               f"{', '.join(planner_names())}")
        if self.policy not in policy_names():
            raise KVStateError(f"policy={self.policy!r} is not a registered eviction policy; choose one of "
                               f"{', '.join(policy_names())}")
        if self.align is not None:
            check_int("align", self.align, 1, 2**31 - 1, error=KVStateError, hint="; None uses the model's chunk size")
        check_float("alpha", self.alpha, 0.0, 1e12, error=KVStateError)
        check_int("block_size", self.block_size, 1, 2**31 - 1, error=KVStateError)
        object.__setattr__(self, "placement", Placement.parse(self.placement))
        if self.remote is not None:
            check_remote_url(self.remote)
        check_float("remote_retry_s", self.remote_retry_s, 0.0, 3600.0, error=KVStateError)
        if self.remote_key_file is not None and (not isinstance(self.remote_key_file, str) or not self.remote_key_file):
            raise KVStateError(f"remote_key_file={self.remote_key_file!r} is not a path; pass the key file's path or None")
        if self.capture_min_saving is not None:
            check_float("capture_min_saving", self.capture_min_saving, 0.0, 1e12, error=KVStateError,
                        hint="; None uses half the checkpoint grid, 0 captures every planned position")
