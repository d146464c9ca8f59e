"""The sparse prefix store as one radix tree with shared KV, driven by transactions (pure; no torch).

Sparse prefix caching ("Sparse Prefix Caching for Hybrid and Recurrent LLM Serving") keeps
dense attention KV for cached prefixes and recurrent states only at sparse positions. Here the cached
prefixes form one radix tree (SGLang's RadixAttention layout): every node owns the KV of its edge's
tokens — one copy of a document however many requests extend it — and recurrent states attach to
absolute positions on nodes. Tensors are opaque payloads; the engine supplies them and a splitter.

A request is one transaction (SGLang: ``match_prefix → insert / lock_ref / evict``):

- :meth:`PrefixStore.begin` matches the request, records its true overlap depth (the longest common
  prefix with the tree, usable checkpoint or not), pins the matched path, plans checkpoints on the
  request's path from what was observed there (before the forward pass), and returns where to resume
  and which positions to capture in this pass;
- :meth:`PrefixStore.commit` inserts the new suffix's KV, the captured states and the last logits,
  charges bytes (each tensor once) and evicts unpinned leaves or single states (LRU or utility) to stay
  within the budget — whole or nothing: when the request cannot fit, the store is left as it was;
  :meth:`PrefixStore.abort` just unpins.

Invariants: only leaves are evicted, so every state's KV prefix exists; a state at the end of a
request's path (depth ``L-1``: what a full hit restores) never takes a planner slot; the planner never
places at ``L-1`` or ``L``. Overlap observations are counts (no decay). Not thread-safe: the engine
locks around each verb.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import numpy.typing as npt

from kvstate.errors import BudgetError
from kvstate.prefix import tree_plan
from kvstate.prefix.eviction import Policy, Unit, eviction_order
from kvstate.prefix.tree_plan import TreeLimits

FloatArray = npt.NDArray[np.float64]
Planner = Callable[[FloatArray, int], list[int]]  # (weights over depths 0..n, n) → positions in 1..n
Splitter = Callable[[Any, int], tuple[Any, Any]]  # (KV payload of an edge, k) → (first k tokens, the rest)
KVSource = Callable[[int, int], Any]  # (start, end) absolute → KV payload of those tokens


@dataclass(eq=False)
class State:
    payload: Any  # opaque recurrent state after ``position`` tokens
    last_access: int
    end: bool  # stored at a request's end (restored by full hits): never takes a planner slot


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


@dataclass(frozen=True)
class StoreMetrics:
    """An immutable snapshot of the store's counters (``PrefixStore.metrics()``)."""

    requests: int = 0
    hits: int = 0
    tokens_total: int = 0  # prompt tokens of every request
    tokens_reused: int = 0  # restored instead of computed
    tokens_recomputed: int = 0
    tokens_lost_to_missing_checkpoint: int = 0  # the tree held them but no state did
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
    checkpoint_bytes: int = 0  # bytes of one recurrent state (0: attention-only model)
    kv_bytes_per_token: int = 0  # attention KV bytes per token (0: pure SSM)
    logits_bytes: int = 0  # bytes of one stored last-position logits row
    has_recurrent: bool = True
    has_attention: bool = True
    policy: Policy = Policy.LRU
    alpha: float = 1.0  # utility policy weight of FLOP efficiency
    flops_per_token: float = 1.0
    placement: str = "path"  # "path": line planner per request path; "tree": exact DP over a subtree
    align: int = 1  # checkpoint grid of the tree placement (the path planner aligns itself)
    tree: TreeLimits = field(default_factory=TreeLimits)  # caps of the tree placement (see tree_plan.py)

    def __post_init__(self) -> None:
        if self.placement not in ("path", "tree"):
            raise BudgetError(f"placement={self.placement!r} must be 'path' or 'tree'.")
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
        if min(self.checkpoint_bytes, self.kv_bytes_per_token, self.logits_bytes) < 0 or self.alpha < 0:
            raise BudgetError("checkpoint_bytes, kv_bytes_per_token, logits_bytes and alpha must be >= 0.")


def _lcp(a: tuple[int, ...], b: tuple[int, ...], start: int) -> int:
    """Common prefix length of ``a`` and ``b[start:]``: slice comparisons (C speed), bisected on a mismatch."""
    n = min(len(a), len(b) - start)
    if a[:n] == b[start : start + n]:
        return n
    lo, hi = 0, n  # a[:lo] matches, a[:hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[start : start + mid]:
            lo = mid
        else:
            hi = mid
    return lo


class PrefixStore:
    """One radix tree of shared KV and sparse recurrent states under one byte budget (see module doc)."""

    def __init__(self, config: StoreConfig, planner: Planner, splitter: Splitter | None = None) -> None:
        self.config = config
        self._planner = planner
        self._split_kv: Splitter = splitter or (lambda kv, k: (kv, kv))
        self.root = Node(0, (), 0, None)
        self._ids = itertools.count(1)
        self._txns = itertools.count(1)
        self._clock = 0
        self._prior: dict[int, float] = {}  # store-wide observed overlap depths (plans paths with no history)
        self._tails: dict[int, float] = {}  # store-wide: tokens after the overlap, of requests that had one
        self._open: dict[int, Txn] = {}
        self._user_pins: dict[tuple[int, ...], list[Node]] = {}
        self._m: dict[str, int] = {f.name: 0 for f in fields(StoreMetrics)}

    # -- queries ---------------------------------------------------------------------------------
    def metrics(self) -> StoreMetrics:
        return StoreMetrics(**self._m)

    def reset_metrics(self) -> None:
        """Zero the counters (bytes held and the peak restart from what is held now)."""
        keep = {k: self._m[k] for k in ("bytes_kv", "bytes_checkpoints", "bytes_end_states", "bytes_logits")}
        self._m = {f.name: 0 for f in fields(StoreMetrics)} | keep
        self._m["peak_bytes"] = self.used_bytes

    @property
    def used_bytes(self) -> int:
        m = self._m
        return m["bytes_kv"] + m["bytes_checkpoints"] + m["bytes_end_states"] + m["bytes_logits"]

    def bytes_by_kind(self) -> dict[str, int]:
        m = self._m
        return {
            "attention_kv": m["bytes_kv"],
            "checkpoints": m["bytes_checkpoints"],
            "end_states": m["bytes_end_states"],
            "logits": m["bytes_logits"],
        }

    def nodes(self) -> list[Node]:
        out, stack = [], list(self.root.children.values())
        while stack:
            v = stack.pop()
            out.append(v)
            stack.extend(v.children.values())
        return out

    def _walk(self, tokens: tuple[int, ...]) -> tuple[list[Node], int]:
        """Nodes the request passes (the last may be matched only partly) and the overlap depth."""
        path: list[Node] = []
        node, pos = self.root, 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            k = _lcp(child.edge, tokens, pos)
            path.append(child)
            pos += k
            if k < len(child.edge):
                break
            node = child
        return path, pos

    def _states_upto(self, path: list[Node], limit: int) -> int:
        best = 0
        for v in path:
            for p in v.states:
                if best < p <= limit:
                    best = p
        return best

    def _find_state(self, path: list[Node], p: int) -> State | None:
        for v in path:
            if v.top < p <= v.depth:
                return v.states.get(p)
        return None

    def lookup(self, tokens: tuple[int, ...]) -> Hit:
        path, t = self._walk(tokens)
        return self._hit(path, t, len(tokens))

    def _hit(self, path: list[Node], t: int, n: int) -> Hit:
        stored = t == n and bool(path) and n in path[-1].logits and path[-1].top < n <= path[-1].depth
        if stored and (not self.config.has_recurrent or n == 1 or self._find_state(path, n - 1) is not None):
            return Hit(n, n, 0, True)
        limit = min(t, n - 1)  # the restored cache stops before the last token (generate feeds it)
        pos = limit if not self.config.has_recurrent else self._states_upto(path, limit)
        return Hit(pos, t, limit - pos, False)

    # -- planning --------------------------------------------------------------------------------
    def _path_weights(self, path: list[Node], t: int, n: int) -> FloatArray:
        """Overlap mass seen along the request's path: requests ending on it, or branching off it, at depth d."""
        w = np.zeros(n + 1)
        w[0] = self.root.sub_mass - sum(v.sub_mass for v in path[:1])
        for i, v in enumerate(path):
            own = 0.0
            for d, m in v.mass.items():
                w[min(d, t)] += m
                own += m
            below = path[i + 1].sub_mass if i + 1 < len(path) else 0.0
            w[min(v.depth, t)] += max(v.sub_mass - own - below, 0.0)
        # the request's new part (beyond t) has no history of its own: one pseudo-observation spread like
        # the store's overlaps, both in absolute depth (system prompts) and as a distance from the request's
        # end (a document followed by a question: the next question diverges where this one starts)
        prior = np.zeros(n + 1)
        for d, m in self._prior.items():
            if t < d < n:
                prior[d] += m
        for k, m in self._tails.items():
            if t < n - k < n:
                prior[n - k] += m
        if prior.sum() > 0:
            w += prior / prior.sum()
        elif w[1:].sum() <= 0:
            w = np.ones(n + 1)  # nothing known at all: spread the checkpoints evenly
        w[max(n - 1, 0) :] = 0.0  # the end state serves overlaps of n-1 and n for free
        return w if w.sum() > 0 else np.ones(n + 1)

    def _observe(self, path: list[Node], t: int, n: int) -> None:
        self._prior[t] = self._prior.get(t, 0.0) + 1.0
        if t > 0:
            self._tails[n - t] = self._tails.get(n - t, 0.0) + 1.0
        self.root.sub_mass += 1.0
        for v in path:
            v.sub_mass += 1.0
        if t > 0:
            last = path[-1]
            last.mass[t] = last.mass.get(t, 0.0) + 1.0

    def _new_part(self, t: int, n: int) -> FloatArray:
        """One pseudo-observation over the request's new part ``(t, n)`` spread like the store's overlaps."""
        prior = np.zeros(n + 1)
        for d, m in self._prior.items():
            if t < d < n:
                prior[d] += m
        for k, m in self._tails.items():
            if t < n - k < n:
                prior[n - k] += m
        if prior.sum() <= 0:  # nothing known: spread evenly (as the path planner does)
            prior[t + 1 : n - 1] = 1.0
        return prior / prior.sum() if prior.sum() > 0 else prior

    def _tree_plan(self, path: list[Node], t: int, n: int) -> tuple[list[int], bool]:
        """Tree placement: the standing plan on the path, or a fresh exact plan of its subtree on drift."""
        c = self.config
        if not tree_plan.needs_plan(path, t, c.tree.drift):
            return [p for p in tree_plan.planned_on_path(path, t) if 0 < p < n - 1], False
        built = self.tree_for(path, t, n)
        return tree_plan.apply(built, tree_plan.solve(built), t, n), True

    def tree_for(self, path: list[Node], t: int, n: int) -> tree_plan.BuiltTree:
        """The bounded subtree the tree placement plans for this request (no mutation)."""
        c = self.config
        return tree_plan.build(self.root, path, t, n, self._new_part(t, n), c.slots_per_entry, c.align, c.tree)

    # -- the transaction -------------------------------------------------------------------------
    def begin(self, tokens: tuple[int, ...], serving: bool = True) -> Txn:
        """Match, record the overlap, pin, plan; see the module docstring. ``serving=False`` (an insert of
        already computed state) records no observation and counts no request."""
        if not tokens:
            raise ValueError("tokens: a request needs at least one token.")
        self._clock += 1
        n = len(tokens)
        path, t = self._walk(tokens)
        if serving:
            self._observe(path, t, n)
        hit = self._hit(path, t, n)
        plan: list[int] = []
        replanned = False
        if self.config.has_recurrent and self.config.slots_per_entry > 0 and n > 2:
            if self.config.placement == "tree":
                plan, replanned = self._tree_plan(path, t, n)
            else:
                plan = [p for p in self._planner(self._path_weights(path, t, n), n) if 0 < p < n - 1]
        capture: set[int] = set()
        if not hit.full:
            for p in plan:
                if p > hit.position and (p > t or self._find_state(path, p) is None):
                    capture.add(p)
            if self.config.has_recurrent and n - 1 > hit.position:
                capture.add(n - 1)
        kv: list[tuple[Any, int]] = []
        upto = n - 1 if hit.full else hit.position
        if self.config.has_attention:
            for v in path:
                if v.top >= upto:
                    break
                kv.append((v.kv, min(v.depth, upto) - v.top))
        state = None
        if self.config.has_recurrent and upto > 0:
            st = self._find_state(path, upto)
            assert st is not None, "a hit position always has a state"
            st.last_access = self._clock
            state = st.payload
        for v in path:
            v.last_access = self._clock
        pinned = path[-1] if path else None
        if pinned is not None:
            pinned.pins += 1
        txn = Txn(
            next(self._txns),
            tokens,
            hit,
            tuple(sorted(capture)),
            tuple(plan),
            tuple(kv),
            state,
            path[-1].logits[n] if hit.full else None,
            pinned,
            replanned,
        )
        self._open[txn.id] = txn
        if not serving:
            return txn
        m = self._m
        m["requests"] += 1
        m["tokens_total"] += n
        m["hits"] += int(hit.position > 0)
        m["tokens_reused"] += hit.position
        m["tokens_recomputed"] += n - hit.position
        m["tokens_lost_to_missing_checkpoint"] += hit.lost
        return txn

    def abort(self, txn: Txn) -> None:
        if self._open.pop(txn.id, None) is not None and txn.pinned is not None:
            txn.pinned.pins -= 1

    def commit(
        self,
        txn: Txn,
        states: dict[int, Any],
        kv: KVSource | None,
        logits: Any = None,
        length: int | None = None,
    ) -> bool:
        """Insert the first ``length`` tokens (default all) with KV from ``kv``, the captured ``states`` and
        the ``logits`` after ``length`` tokens. Whole or nothing; returns False when it could not fit."""
        if self._open.pop(txn.id, None) is None:
            raise ValueError(f"transaction {txn.id} is not open (committed or aborted already).")
        try:
            return self._commit(txn, states, kv, logits, len(txn.tokens) if length is None else length)
        finally:
            if txn.pinned is not None:
                txn.pinned.pins -= 1

    def _commit(
        self, txn: Txn, states: dict[int, Any], kv: KVSource | None, logits: Any, length: int
    ) -> bool:
        c = self.config
        tokens = txn.tokens[:length]
        if length < 1 or length > len(txn.tokens):
            raise ValueError(f"length={length} must be in 1..{len(txn.tokens)}.")
        if c.has_attention and kv is None and length > 0:
            raise ValueError("kv: an attention model's commit needs the KV of the new tokens.")
        path, t = self._walk(tokens)
        ends = {length - 1, length} if length > 1 else {length}
        new_states = {p: s for p, s in states.items() if 0 < p <= length and c.has_recurrent}
        new_states = {p: s for p, s in new_states.items() if p > t or self._find_state(path, p) is None}
        add_logits = logits is not None and not (t == length and bool(path) and length in path[-1].logits)
        # slots: at most `slots_per_entry` planned (non-end) states on this path; unplanned ones go first (LRU)
        existing = [
            p for v in path for p, s in v.states.items() if p <= length and not s.end and p not in ends
        ]
        over = len(existing) + len([p for p in new_states if p not in ends]) - c.slots_per_entry
        unplanned = sorted(
            (p for p in existing if p not in txn.plan), key=lambda p: self._state_clock(path, p)
        )
        trim = unplanned[: max(over, 0)]
        if c.placement == "tree":  # planned states stay; unplanned ones go (oldest first) past the path's share
            keep = [p for p in unplanned if any(p in v.planned for v in path if v.top < p <= v.depth)]
            planned_here = len(existing) - len(unplanned) + len(keep) + len(new_states.keys() - ends)
            over = len(existing) + len(new_states.keys() - ends) - max(c.slots_per_entry, planned_here)
            trim = [p for p in unplanned if p not in keep][: max(over, 0)]
        base = ((length - t) * c.kv_bytes_per_token if c.has_attention else 0) + (
            c.logits_bytes if add_logits else 0
        )
        protect = {id(v) for v in path}
        victims = self._choose_victims(base + c.checkpoint_bytes * (len(new_states) - len(trim)), protect)
        if victims is None:  # retry keeping only the end state
            trim = []
            new_states = {p: s for p, s in new_states.items() if p in ends}
            victims = self._choose_victims(base + c.checkpoint_bytes * len(new_states), protect)
        if victims is None:
            self._m["rejected_inserts"] += 1
            return False
        for p in trim:
            self._drop_state(path, p)
        self._evict(victims)
        leaf = self._insert_path(tokens, kv)
        path, _ = self._walk(tokens)
        if c.placement == "tree" and leaf is not None and leaf.plan_sub is None and txn.replanned:
            leaf.planned = {p for p in txn.plan if leaf.top < p <= leaf.depth}  # the virtual leaf's points
            leaf.plan_sub, leaf.plan_own = leaf.sub_mass, sum(leaf.mass.values())
        for p, payload in new_states.items():
            v = next(u for u in path if u.top < p <= u.depth)
            if p in v.states:
                continue
            v.states[p] = State(payload, self._clock, end=p in ends)
            self._m["bytes_end_states" if p in ends else "bytes_checkpoints"] += c.checkpoint_bytes
        if add_logits and leaf is not None and length not in leaf.logits:
            leaf.logits[length] = logits
            self._m["bytes_logits"] += c.logits_bytes
        for v in path:
            v.last_access = self._clock
        self._m["peak_bytes"] = max(self._m["peak_bytes"], self.used_bytes)
        return True

    def _state_clock(self, path: list[Node], p: int) -> int:
        s = self._find_state(path, p)
        return s.last_access if s is not None else 0

    def _drop_state(self, path: list[Node], p: int) -> None:
        for v in path:
            if p in v.states and v.top < p <= v.depth:
                s = v.states.pop(p)
                self._m["bytes_end_states" if s.end else "bytes_checkpoints"] -= self.config.checkpoint_bytes
                return

    def _insert_path(self, tokens: tuple[int, ...], kv: KVSource | None) -> Node | None:
        """Make ``tokens`` a path of the tree (splitting an edge where it diverges); the node ending at
        ``len(tokens)``."""
        node, pos = self.root, 0
        n = len(tokens)
        while pos < n:
            child = node.children.get(tokens[pos])
            if child is None:
                leaf = Node(next(self._ids), tokens[pos:], n, node, kv(pos, n) if kv is not None else None)
                leaf.last_access = self._clock
                node.children[tokens[pos]] = leaf
                if self.config.has_attention:
                    self._m["bytes_kv"] += (n - pos) * self.config.kv_bytes_per_token
                return leaf
            k = _lcp(child.edge, tokens, pos)
            if k < len(child.edge):
                child = self._split(child, k)
            node, pos = child, pos + k
        return node if node is not self.root else None

    def _split(self, child: Node, k: int) -> Node:
        """Cut ``child``'s edge after ``k`` tokens; the new upper node is returned, ``child`` keeps the rest."""
        parent = child.parent
        assert parent is not None
        upper_kv, lower_kv = self._split_kv(child.kv, k) if child.kv is not None else (None, None)
        cut = child.top + k
        mid = Node(next(self._ids), child.edge[:k], cut, parent, upper_kv)
        mid.last_access = child.last_access
        mid.sub_mass = child.sub_mass
        for name in ("states", "logits", "mass"):
            src = getattr(child, name)
            setattr(mid, name, {p: x for p, x in src.items() if p <= cut})
            setattr(child, name, {p: x for p, x in src.items() if p > cut})
        mid.planned = {p for p in child.planned if p <= cut}
        child.planned = {p for p in child.planned if p > cut}
        child.plan_sub = None  # both halves re-plan when a request next passes them
        child.sub_mass -= sum(mid.mass.values())
        parent.children[child.edge[0]] = mid
        child.edge = child.edge[k:]
        child.kv = lower_kv
        child.parent = mid
        mid.children[child.edge[0]] = child
        return mid

    # -- eviction --------------------------------------------------------------------------------
    def _is_leaf(self, v: Node, gone: set[int]) -> bool:
        return all(id(u) in gone for u in v.children.values())

    def _units(self, protect: set[int]) -> list[tuple[Unit, Node]]:
        c = self.config
        out = []
        nodes = self.nodes()
        held: set[int] = set()  # pinned nodes and their ancestors keep their states too
        for v in nodes:
            u: Node | None = v if v.pins else None
            while u is not None and id(u) not in held:
                held.add(id(u))
                u = u.parent
        for v in nodes:
            for p, s in v.states.items():
                if id(v) in held:
                    continue
                saved = float(p - v.top) * max(v.sub_mass, 0.0)
                out.append((Unit(v.id, p, c.checkpoint_bytes, s.last_access, saved), v))
            if id(v) not in protect and v.pins == 0 and not v.children:
                out.append(
                    (Unit(v.id, None, self._node_bytes(v), v.last_access, len(v.edge) * v.sub_mass), v)
                )
        return out

    def _node_bytes(self, v: Node) -> int:
        c = self.config
        kv = len(v.edge) * c.kv_bytes_per_token if c.has_attention else 0
        return kv + len(v.states) * c.checkpoint_bytes + len(v.logits) * c.logits_bytes

    def _choose_victims(self, need: int, protect: set[int]) -> list[tuple[Unit, Node]] | None:
        """Units to evict so that ``need`` more bytes fit (no mutation), or None when they cannot."""
        over = self.used_bytes + need - self.config.budget_bytes
        if over <= 0:
            return []
        units = self._units(protect)
        order = eviction_order(
            [u for u, _ in units], self.config.policy, self.config.flops_per_token, self.config.alpha
        )
        by_unit = {id(u): v for u, v in units}
        gone: set[int] = set()  # nodes evicted whole
        dropped: set[tuple[int, int]] = set()
        chosen: list[tuple[Unit, Node]] = []
        freed = 0
        queue = list(order)
        i = 0
        while freed < over and i < len(queue):
            u = queue[i]
            i += 1
            v = by_unit[id(u)]
            if id(v) in gone:
                continue
            if u.position is None:
                nbytes = self._node_bytes(v) - sum(
                    self.config.checkpoint_bytes for (nid, _) in dropped if nid == v.id
                )
                gone.add(id(v))
                chosen.append((u, v))
                freed += nbytes
                par = v.parent  # a parent left childless becomes an evictable leaf
                free = par is not None and par is not self.root and id(par) not in protect and par.pins == 0
                if par is not None and free and self._is_leaf(par, gone):
                    pu = Unit(par.id, None, self._node_bytes(par), par.last_access, 0.0)
                    by_unit[id(pu)] = par
                    queue.insert(i, pu)
            else:
                dropped.add((v.id, u.position))
                chosen.append((u, v))
                freed += u.nbytes
        return chosen if freed >= over else None

    def _evict(self, victims: list[tuple[Unit, Node]]) -> None:
        for u, v in victims:
            if u.position is None:
                self._remove_leaf(v)
            elif u.position in v.states and (v.parent is not None):
                s = v.states.pop(u.position)
                self._m["bytes_end_states" if s.end else "bytes_checkpoints"] -= self.config.checkpoint_bytes
                self._m["evicted_states"] += 1
        self._prune_empty()

    def _remove_leaf(self, v: Node) -> None:
        if v.parent is None or v.parent.children.get(v.edge[0]) is not v:
            return  # already removed with a subtree
        c = self.config
        for u in [v, *self._below(v)]:
            self._m["bytes_kv"] -= len(u.edge) * c.kv_bytes_per_token if c.has_attention else 0
            for s in u.states.values():
                self._m["bytes_end_states" if s.end else "bytes_checkpoints"] -= c.checkpoint_bytes
            self._m["bytes_logits"] -= len(u.logits) * c.logits_bytes
        del v.parent.children[v.edge[0]]
        anc: Node | None = v.parent
        while anc is not None:
            anc.sub_mass -= v.sub_mass
            anc = anc.parent
        self._m["evicted_nodes"] += 1

    def _below(self, v: Node) -> list[Node]:
        out, stack = [], list(v.children.values())
        while stack:
            u = stack.pop()
            out.append(u)
            stack.extend(u.children.values())
        return out

    def _prune_empty(self) -> None:
        """Without attention KV a node is only worth its states: drop unpinned leaves that hold nothing."""
        if self.config.has_attention:
            return
        changed = True
        while changed:
            changed = False
            for v in self.nodes():
                if not v.children and not v.states and not v.logits and v.pins == 0:
                    self._remove_leaf(v)
                    self._m["evicted_nodes"] -= 1  # bookkeeping, not an eviction
                    changed = True

    # -- user pins -------------------------------------------------------------------------------
    def pin(self, tokens: tuple[int, ...]) -> None:
        """Keep the stored path of ``tokens`` from eviction until :meth:`unpin`."""
        path, t = self._walk(tokens)
        if t < len(tokens) or not path:
            raise BudgetError(
                f"pin: only {t} of the {len(tokens)} tokens are stored; insert the prefix first."
            )
        path[-1].pins += 1
        self._user_pins.setdefault(tokens, []).append(path[-1])

    def unpin(self, tokens: tuple[int, ...]) -> None:
        nodes = self._user_pins.get(tokens)
        if not nodes:
            raise BudgetError("unpin: this prefix is not pinned; pin it first.")
        nodes.pop().pins -= 1
        if not nodes:
            del self._user_pins[tokens]

    def pinned_bytes(self) -> int:
        """Bytes of the paths held by user pins (each node once)."""
        seen: dict[int, Node] = {}
        for nodes in self._user_pins.values():
            for v in nodes:
                u: Node | None = v
                while u is not None and u is not self.root and id(u) not in seen:
                    seen[id(u)] = u
                    u = u.parent
        return sum(self._node_bytes(v) for v in seen.values())
