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
from dataclasses import fields
from typing import Any

from kvstate.errors import BudgetError
from kvstate.prefix.store_eviction import TreeEviction
from kvstate.prefix.store_learning import OverlapLearning
from kvstate.prefix.store_types import (
    Hit,
    KVSource,
    Node,
    Planner,
    Splitter,
    State,
    StoreConfig,
    StoreMetrics,
    Txn,
)

__all__ = ["Hit", "KVSource", "Node", "Planner", "PrefixStore", "Splitter", "State", "StoreConfig", "StoreMetrics",
           "Txn"]


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


class PrefixStore(OverlapLearning, TreeEviction):
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
