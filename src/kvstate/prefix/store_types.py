"""Records and configuration of the sparse prefix store (pure; no torch): tree nodes, stored states,
hits, open transactions, metrics and the store's budget settings.

Sparse prefix caching ("Sparse Prefix Caching for Hybrid and Recurrent LLM Serving"): the store
(:mod:`kvstate.prefix.store`) keeps these in one radix tree; tensors are opaque payloads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from kvstate.errors import BudgetError
from kvstate.prefix.eviction import Policy
from kvstate.prefix.placement import Placement
from kvstate.prefix.tree_plan import Stamp, TreeLimits

FloatArray = npt.NDArray[np.float64]
Planner = Callable[[FloatArray, int], list[int]]  # (weights over depths 0..n, n) → positions in 1..n
Splitter = Callable[[Any, int], tuple[Any, Any]]  # (KV payload of an edge, k) → (first k tokens, the rest)
KVSource = Callable[[int, int], Any]  # (start, end) absolute → KV payload of those tokens
# (event "stored" / "evicted", kind "kv" / "state", the path's tokens, start of the KV span) → None
Observer = Callable[[str, str, tuple[int, ...], int], None]
Sizer = Callable[[Any], int]  # a stored state's or logits row's payload → the bytes it holds


@dataclass(eq=False)
class State:
    payload: Any  # opaque recurrent state after ``position`` tokens
    last_access: int
    end: bool  # stored at a request's end (restored by full hits): never takes a planner slot
    nbytes: int  # bytes the payload holds, charged to the budget (measured once, on insert)


@dataclass(eq=False)
class Node:
    id: int
    edge: tuple[int, ...]  # tokens on the edge from the parent
    depth: int  # absolute depth at the end of the edge
    parent: Node | None
    kv: Any = None  # opaque KV of the edge's tokens (None without attention layers)
    children: dict[int, Node] = field(default_factory=dict)
    states: dict[int, State] = field(default_factory=dict)  # absolute position in (top, depth] → state
    logits: dict[int, Any] = field(
        default_factory=dict
    )  # absolute depth in (top, depth] → last-position logits
    logits_nbytes: dict[int, int] = field(default_factory=dict)  # the same depths → bytes those logits hold
    mass: dict[int, float] = field(default_factory=dict)  # observed overlaps ending at depth in (top, depth]
    sub_mass: float = 0.0  # mass on this node and below
    pins: int = 0  # in-flight transactions and user pins
    last_access: int = 0
    planned: set[int] = field(default_factory=set)  # tree placement: planned checkpoint positions on the edge
    plan_sub: float | None = None  # tree placement: sub_mass when last planned (None: never, or cut since)
    plan_own: float = 0.0  # tree placement: own mass when last planned

    @property
    def top(self) -> int:
        return self.depth - len(self.edge)


@dataclass(frozen=True)
class Hit:
    position: int  # restore the state after this many tokens (0: nothing usable)
    overlap: int  # tokens the request shares with the tree
    lost: int  # tokens the KV covered but no recurrent state did
    full: bool  # the whole request is stored with its logits: nothing to compute


@dataclass(frozen=True)
class Txn:
    id: int
    tokens: tuple[int, ...]
    hit: Hit
    capture: tuple[int, ...]  # positions in (hit.position, n) whose state this pass must capture
    plan: tuple[int, ...]  # the planned checkpoint positions on the request's path (slots)
    kv: tuple[tuple[Any, int], ...]  # (edge KV payload, tokens of it to use) from the root to hit.position
    state: Any  # recurrent payload at hit.position (None: none needed or attention-only)
    logits: Any  # stored logits for a full hit (else None)
    pinned: Node | None
    replanned: bool = False  # tree placement: this request re-planned its subtree
    # what the request teaches the store, applied by commit only (abort and a rejected commit leave the
    # overlap counts, clocks and plan stamps as they were):
    serving: bool = True  # a served request: its overlap (``hit.overlap``) is observed and it is counted
    stamps: tuple[Stamp, ...] = ()  # tree placement: the plan stamps of its re-plan
    version: int = 0  # the store's commit count at begin (stamps apply only to the tree they were made on)
    boundaries: tuple[int, ...] = ()  # the declared boundaries that took a slot (a subset of ``plan``)


@dataclass(frozen=True)
class StoreMetrics:
    """An immutable snapshot of the store's counters (``PrefixStore.metrics()``)."""

    requests: int = 0  # served requests, counted on commit (stored or rejected); an aborted one is not
    hits: int = 0
    tokens_total: int = 0  # prompt tokens of every request
    tokens_reused: int = 0  # restored instead of computed
    tokens_recomputed: int = 0
    tokens_lost_to_missing_checkpoint: int = 0  # cumulative: the tree held them but no state did
    evicted_nodes: int = 0
    evicted_states: int = 0
    rejected_inserts: int = 0  # commits that could not fit and left the store unchanged
    bytes_kv: int = 0
    bytes_checkpoints: int = 0  # planned sparse states
    bytes_end_states: int = 0
    bytes_logits: int = 0
    peak_bytes: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.requests if self.requests else 0.0

    @property
    def used_bytes(self) -> int:
        return self.bytes_kv + self.bytes_checkpoints + self.bytes_end_states + self.bytes_logits


@dataclass(frozen=True)
class StoreConfig:
    budget_bytes: int  # global byte budget over KV, states and logits
    slots_per_entry: int = 8  # planned checkpoints per request path (end states are extra)
    # bytes of one recurrent state (0: attention-only model) and of one logits row: estimates for budget
    # checks and for stores without a sizer; with a sizer the store charges what each payload holds
    checkpoint_bytes: int = 0
    kv_bytes_per_token: int = 0  # attention KV bytes per token (0: pure SSM)
    logits_bytes: int = 0
    has_recurrent: bool = True
    has_attention: bool = True
    policy: str = Policy.LRU.value  # a registered eviction policy (kvstate.prefix.eviction.POLICIES)
    alpha: float = 1.0  # utility policy weight of FLOP efficiency
    flops_per_token: float = 1.0
    placement: Placement = Placement.PATH  # PATH: line planner per request path; TREE: exact DP over a subtree
    align: int = 1  # checkpoint grid of the tree placement (the path planner aligns itself)
    tree: TreeLimits = field(default_factory=TreeLimits)  # caps of the tree placement (see tree_plan.py)
    # a capture costs an extra forward call: make it only when the tokens it is expected to save later
    # (the overlap mass it serves × the tokens it saves over the next shallower state) reach this; 0: always
    capture_min_saving: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "placement", Placement.parse(self.placement, error=BudgetError))
        if self.align < 1:
            raise BudgetError(f"align={self.align} must be >= 1.")
        if self.slots_per_entry < 0:
            raise BudgetError(f"slots_per_entry={self.slots_per_entry} must be >= 0.")
        if self.budget_bytes <= 0:
            raise BudgetError(f"budget_bytes={self.budget_bytes} must be positive.")
        if self.has_recurrent and self.budget_bytes < self.checkpoint_bytes:
            raise BudgetError(
                f"budget_bytes={self.budget_bytes:,} is smaller than one recurrent checkpoint, which needs "
                f"{self.checkpoint_bytes:,} bytes; raise the budget to at least that."
            )
        if not self.capture_min_saving >= 0:  # NaN fails too
            raise BudgetError(f"capture_min_saving={self.capture_min_saving} must be a number >= 0.")
        if min(self.checkpoint_bytes, self.kv_bytes_per_token, self.logits_bytes) < 0 or self.alpha < 0:
            raise BudgetError("checkpoint_bytes, kv_bytes_per_token, logits_bytes and alpha must be >= 0.")
