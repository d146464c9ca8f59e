"""The sparse prefix store as one radix tree with shared KV, driven by transactions (pure; no torch).

Sparse prefix caching ("Sparse Prefix Caching for Hybrid and Recurrent LLM Serving") keeps
dense attention KV for cached prefixes and recurrent states only at sparse positions. Here the cached
prefixes form one radix tree (SGLang's RadixAttention layout): every node owns the KV of its edge's
tokens — one copy of a document however many requests extend it — and recurrent states attach to
absolute positions on nodes. Tensors are opaque payloads; the engine supplies them and a splitter.

A request is one transaction (SGLang: ``match_prefix → insert / lock_ref / evict``):

- :meth:`PrefixStore.begin` matches the request, measures its true overlap depth (the longest common
  prefix with the tree, usable checkpoint or not), pins the matched path, plans checkpoints on the
  request's path from what was observed there — its own overlap included — and from the boundaries it
  declares, and returns where to resume and which positions to capture in this pass. It changes nothing
  but the pin: what the request teaches (its overlap, the LRU clocks of what it used, tree-plan stamps)
  rides in the transaction;
- :meth:`PrefixStore.commit` inserts the new suffix's KV, the captured states and the last logits,
  charges bytes (each payload once, what it really holds when the store has a ``sizer``), evicts unpinned
  leaves or single states (LRU or utility) to stay within the budget, and applies what the request
  teaches — whole or nothing: when the request cannot fit, the store (tree, counts, clocks) is left as it
  was and only the metrics count a served request and a rejected insert; a full hit commits with nothing
  to insert; :meth:`PrefixStore.abort` (the request was not served) just unpins.

Invariants: only leaves are evicted, so every state's KV prefix exists; a state at the end of a
request's path (depth ``L-1``: what a full hit restores) never takes a planner slot; the planner never
places at ``L-1`` or ``L``; a commit counts and trims states only on the part of the path it shares (a
state deeper on the node where it leaves the tree belongs to another branch). Overlap observations are
counts (no decay). Not thread-safe: the engine locks around each verb. After a run of
``NO_REUSE_WARN_AFTER`` served requests that overlapped the store by at least ``max(align,
DRY_MIN_OVERLAP)`` tokens but reused nothing (requests with less overlap neither extend nor break the
run), the ``kvstate.prefix`` logger warns once.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Sequence
from dataclasses import fields
from typing import Any

import numpy as np

from kvstate.errors import BudgetError, KVStateError
from kvstate.prefix import tree_plan
from kvstate.prefix.placement import Placement
from kvstate.prefix.store_eviction import TreeEviction
from kvstate.prefix.store_learning import OverlapLearning, Undo
from kvstate.prefix.store_types import (
    FloatArray,
    Hit,
    KVSource,
    Node,
    Observer,
    Planner,
    Sizer,
    Splitter,
    State,
    StoreConfig,
    StoreMetrics,
    Txn,
)
from kvstate.prefix.tree_plan import Stamp

log = logging.getLogger("kvstate.prefix")
NO_REUSE_WARN_AFTER = 32  # served requests in a row with an overlap and no reuse before the one warning
DRY_MIN_OVERLAP = 16  # overlap (tokens, and at least one `align` step) that such a request must have had

__all__ = ["Hit", "KVSource", "Node", "Planner", "PrefixStore", "Sizer", "Splitter", "State", "StoreConfig",
           "StoreMetrics", "Txn", "check_boundaries", "paying_captures"]


def check_boundaries(boundaries: Sequence[int], n: int) -> tuple[int, ...]:
    """Declared boundaries of a request of ``n`` tokens: ints in ``1..n``, strictly increasing."""
    fix = "pass sorted(set(b for b in boundaries if 0 < b <= len(input_ids)))"
    if isinstance(boundaries, str | bytes | dict) or not isinstance(boundaries, Iterable):
        raise KVStateError(
            f"boundaries={boundaries!r} is not a list of token positions; pass a list of ints in 1..{n}, e.g. "
            f"boundaries=[{n}] for one position."
        )
    got = list(boundaries)
    bad = [b for b in got if isinstance(b, bool) or not isinstance(b, (int, np.integer))]
    if bad:
        raise KVStateError(f"boundaries: {bad[:5]!r} are not token positions (ints); {fix}.")
    out = tuple(int(b) for b in got)
    outside = [b for b in out if not 0 < b <= n]
    if outside:
        raise KVStateError(
            f"boundaries: {outside[:5]} lie outside 1..{n} (a boundary b keeps the state after the first b of "
            f"the request's {n} tokens); {fix}."
        )
    if any(a >= b for a, b in itertools.pairwise(out)):
        raise KVStateError(
            f"boundaries: {list(out[:10])} must be strictly increasing (sorted, no duplicates); {fix}."
        )
    return out


def paying_captures(
    weights: FloatArray, capture: Sequence[int], start: int, end: int, min_saving: float
) -> list[int]:
    """The captures worth their extra forward call: each checkpoint ``p`` saves ``p - prev`` tokens (``prev``:
    the next shallower state — another capture, the resume point ``start``, or nothing) for every overlap
    observed at a depth it serves (``p`` up to the next deeper capture, or to the request's end state at
    ``end``, which serves the depths from there on). Repeatedly drops the capture whose expected saving (that
    mass × those tokens) is lowest while it is below ``min_saving``; what remains all pays off.
    ``weights``: overlap mass over depths ``0..n``; captures lie in ``(start, end)``."""
    keep = sorted(capture)
    mass = np.concatenate(([0.0], np.cumsum(np.asarray(weights, dtype=np.float64))))  # mass[d] = w[:d].sum()
    while keep:
        anchors = [start, *keep, end]
        saving = [(p - anchors[i]) * (mass[anchors[i + 2]] - mass[p]) for i, p in enumerate(keep)]
        worst = int(np.argmin(saving))
        if saving[worst] >= min_saving:
            break
        keep.pop(worst)
    return keep


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

    def __init__(
        self,
        config: StoreConfig,
        planner: Planner,
        splitter: Splitter | None = None,
        sizer: Sizer | None = None,
        observer: Observer | None = None,
    ) -> None:
        """``sizer``: the bytes a state or logits payload holds (None: ``config.checkpoint_bytes`` and
        ``config.logits_bytes`` for every one — fake payloads). ``observer(event, kind, tokens, start)``
        hears every change of what is stored: ``event`` "stored" / "evicted", ``kind`` "kv" (the KV of
        ``tokens[start:]``, ``tokens`` the whole path from the root) or "state" (the state after
        ``len(tokens)`` tokens; ``start`` 0)."""
        self.config = config
        self._observer = observer
        self._planner = planner
        self._split_kv: Splitter = splitter or (lambda kv, k: (kv, kv))
        self._sizer = sizer
        self.root = Node(0, (), 0, None)
        self._ids = itertools.count(1)
        self._txns = itertools.count(1)
        self._clock = 0
        self._prior: dict[int, float] = {}  # store-wide observed overlap depths (plans paths with no history)
        self._tails: dict[int, float] = {}  # store-wide: tokens after the overlap, of requests that had one
        self._open: dict[int, Txn] = {}
        self._user_pins: dict[tuple[int, ...], list[Node]] = {}
        self._m: dict[str, int] = {f.name: 0 for f in fields(StoreMetrics)}
        self._version = 0  # successful commits: a tree-plan stamp applies only to the tree it was made on
        self._dry = 0  # served requests in a row that overlapped the store but reused nothing
        self._warned = False

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

    def lookup(self, tokens: tuple[int, ...], full_state: bool = False) -> Hit:
        path, t = self._walk(tokens)
        return self._hit(path, t, len(tokens), full_state)

    def _hit(self, path: list[Node], t: int, n: int, full_state: bool = False) -> Hit:
        stored = t == n and bool(path) and n in path[-1].logits and path[-1].top < n <= path[-1].depth
        end = n if full_state else n - 1  # the state a full hit restores
        if stored and (not self.config.has_recurrent or end == 0 or self._find_state(path, end) is not None):
            return Hit(n, n, 0, True)
        limit = min(t, n - 1)  # the restored cache stops before the last token (generate feeds it)
        pos = limit if not self.config.has_recurrent else self._states_upto(path, limit)
        return Hit(pos, t, limit - pos, False)

    # -- the transaction -------------------------------------------------------------------------
    def begin(
        self, tokens: tuple[int, ...], serving: bool = True, boundaries: Sequence[int] = (), full_state: bool = False
    ) -> Txn:
        """Match, pin, plan; see the module docstring. Nothing is learned here: what the request teaches
        (its overlap, the clocks it touches, tree-plan stamps) is applied by :meth:`commit`. ``serving=False``
        (an insert of already computed state) records no observation and counts no request.
        ``boundaries``: positions the caller expects later requests to part at (see ``_with_boundaries``).
        ``full_state``: the request's end state is the one after all ``n`` tokens (a caller that decodes from
        the last logits) instead of after ``n - 1`` (what ``generate`` extends by feeding the last token)."""
        if not tokens:
            raise ValueError("tokens: a request needs at least one token.")
        n = len(tokens)
        declared = check_boundaries(boundaries, n)
        path, t = self._walk(tokens)
        hit = self._hit(path, t, n, full_state)
        end = n if full_state else n - 1
        plan: list[int] = []
        taken: tuple[int, ...] = ()
        stamps: tuple[Stamp, ...] | None = None
        weights: FloatArray | None = None
        if self.config.has_recurrent and self.config.slots_per_entry > 0 and n > 2:
            undo = self._observe(path, t, n) if serving else None  # the plan sees this request's own overlap
            try:
                if self.config.placement is Placement.TREE:
                    plan, stamps = self._tree_plan(path, t, n)
                else:
                    weights = self._path_weights(path, t, n, declared)
                    plan = [p for p in self._planner(weights, n) if 0 < p < n - 1]
                plan, taken = self._with_boundaries(plan, declared, path, t, n)
                if self.config.capture_min_saving > 0 and not hit.full and weights is None:
                    weights = self._path_weights(path, t, n, declared)
            finally:
                if undo is not None:
                    undo()
        capture: set[int] = set()
        if not hit.full:
            for p in plan:
                if p > hit.position and (p > t or self._find_state(path, p) is None):
                    capture.add(p)
            if capture and weights is not None and self.config.capture_min_saving > 0:
                capture = set(paying_captures(weights, sorted(capture), hit.position, end,
                                              self.config.capture_min_saving))
            if self.config.has_recurrent and end > hit.position:
                capture.add(end)
        kv: list[tuple[Any, int]] = []
        upto = end if hit.full else hit.position
        if self.config.has_attention:
            for v in path:
                if v.top >= upto:
                    break
                kv.append((v.kv, min(v.depth, upto) - v.top))
        state = None
        if self.config.has_recurrent and upto > 0:
            st = self._find_state(path, upto)
            assert st is not None, "a hit position always has a state"
            state = st.payload
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
            stamps is not None,
            serving,
            stamps or (),
            self._version,
            taken,
        )
        self._open[txn.id] = txn
        return txn

    def abort(self, txn: Txn) -> None:
        """The request was not served (its forward pass failed): unpin; the store is left exactly as it was
        (tree, states, overlap counts, clocks, plans and metrics). Idempotent."""
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
        the ``logits`` after ``length`` tokens; learn from the request (its overlap, LRU clocks, plan stamps)
        and count it. Whole or nothing; returns False when it could not fit (the request is still counted
        as served, nothing else changes). A full hit commits with nothing to insert (``{}, None``)."""
        if self._open.pop(txn.id, None) is None:
            raise ValueError(f"transaction {txn.id} is not open (committed or aborted already).")
        try:
            return self._commit(txn, states, kv, logits, len(txn.tokens) if length is None else length)
        finally:
            if txn.pinned is not None:
                txn.pinned.pins -= 1

    def _learn(self, txn: Txn, path: list[Node], length: int) -> Undo:
        """Apply what the request teaches — its overlap (counts) and the clocks of what it used (``path``:
        the walk of its first ``length`` tokens); returns the undo (a commit that cannot fit leaves them as
        they were). The overlap was measured at begin; it lands on the nodes now below that depth."""
        saved: list[tuple[Any, str, int]] = [(self, "_clock", self._clock)]
        self._clock += 1
        undo_obs: Undo | None = None
        if txn.serving:
            seen = txn.hit.overlap
            opath = path if length == len(txn.tokens) else self._walk(txn.tokens)[0]
            undo_obs = self._observe([v for v in opath if v.top < seen], seen, len(txn.tokens))
        used = self._find_state(path, txn.hit.position) if txn.hit.position else None
        touched: list[State | Node] = [*([used] if used is not None else []), *path]
        for x in touched:
            saved.append((x, "last_access", x.last_access))
            x.last_access = self._clock

        def undo() -> None:
            if undo_obs is not None:
                undo_obs()
            for obj, name, old in reversed(saved):
                setattr(obj, name, old)

        return undo

    def _count(self, txn: Txn) -> None:
        """Count a served request (stored or not) and watch for overlaps that never pay off."""
        if not txn.serving:
            return
        m, hit, n = self._m, txn.hit, len(txn.tokens)
        m["requests"] += 1
        m["tokens_total"] += n
        m["hits"] += int(hit.position > 0)
        m["tokens_reused"] += hit.position
        m["tokens_recomputed"] += n - hit.position
        m["tokens_lost_to_missing_checkpoint"] += hit.lost
        if hit.position > 0:
            self._dry = 0
        elif hit.overlap >= max(self.config.align, DRY_MIN_OVERLAP):
            # a shorter overlap (a shared BOS token) says nothing about reuse, nor does none at all
            self._dry += 1
            if self._dry == NO_REUSE_WARN_AFTER and not self._warned:
                self._warned = True
                log.warning(
                    "prefix cache: %d requests in a row overlapped the store but reused nothing (%d tokens "
                    "lost to missing checkpoints so far); declare where requests part "
                    "(prefill(..., boundaries=...), chat_boundaries), or raise slots_per_entry or lower align.",
                    NO_REUSE_WARN_AFTER,
                    m["tokens_lost_to_missing_checkpoint"],
                )

    def _commit(
        self, txn: Txn, states: dict[int, Any], kv: KVSource | None, logits: Any, length: int
    ) -> bool:
        c = self.config
        tokens = txn.tokens[:length]
        if length < 1 or length > len(txn.tokens):
            raise ValueError(f"length={length} must be in 1..{len(txn.tokens)}.")
        path, t = self._walk(tokens)
        if c.has_attention and kv is None and length > t:
            raise ValueError("kv: an attention model's commit needs the KV of the new tokens.")
        self._count(txn)
        if txn.hit.full and t == length and not states and logits is None:  # nothing to insert
            self._learn(txn, path, length)
            self._stamp(txn)
            self._version += 1
            return True
        ends = {length - 1, length} if length > 1 else {length}
        new_states = {p: s for p, s in states.items() if 0 < p <= length and c.has_recurrent}
        new_states = {p: s for p, s in new_states.items() if p > t or self._find_state(path, p) is None}
        add_logits = logits is not None and not (t == length and bool(path) and length in path[-1].logits)
        undo = self._learn(txn, path, length)  # before choosing victims: the utility policy reads the counts
        # slots: at most `slots_per_entry` planned (non-end) states on the part of the path this request
        # shares (depths <= t; states deeper on the last node belong to another branch); unplanned go first
        existing = [
            p
            for v in path
            for p, s in v.states.items()
            if p <= min(t, length) and not s.end and p not in ends
        ]
        over = len(existing) + len([p for p in new_states if p not in ends]) - c.slots_per_entry
        unplanned = sorted(
            (p for p in existing if p not in txn.plan), key=lambda p: self._state_clock(path, p)
        )
        trim = unplanned[: max(over, 0)]
        if c.placement is Placement.TREE:  # planned states stay; unplanned ones go (oldest first) past the path's share
            keep = [p for p in unplanned if any(p in v.planned for v in path if v.top < p <= v.depth)]
            planned_here = len(existing) - len(unplanned) + len(keep) + len(new_states.keys() - ends)
            over = len(existing) + len(new_states.keys() - ends) - max(c.slots_per_entry, planned_here)
            trim = [p for p in unplanned if p not in keep][: max(over, 0)]
        sizes = {p: self._sizeof(x, c.checkpoint_bytes) for p, x in new_states.items()}
        logits_size = self._sizeof(logits, c.logits_bytes) if add_logits else 0
        base = ((length - t) * c.kv_bytes_per_token if c.has_attention else 0) + logits_size
        protect = {id(v) for v in path}
        freed = sum(self._state_bytes(path, p) for p in trim)
        victims = self._choose_victims(base + sum(sizes.values()) - freed, protect)
        if victims is None:  # retry keeping only the end state
            trim = []
            new_states = {p: s for p, s in new_states.items() if p in ends}
            victims = self._choose_victims(base + sum(sizes[p] for p in new_states), protect)
        if victims is None:
            undo()
            self._m["rejected_inserts"] += 1
            return False
        self._stamp(txn)
        for p in trim:
            self._drop_state(path, p)
        self._evict(victims)
        leaf = self._insert_path(tokens, kv)
        path, _ = self._walk(tokens)
        if c.placement is Placement.TREE and leaf is not None and leaf.plan_sub is None and txn.replanned:
            leaf.planned = {p for p in txn.plan if leaf.top < p <= leaf.depth}  # the virtual leaf's points
            leaf.plan_sub, leaf.plan_own = leaf.sub_mass, sum(leaf.mass.values())
        for p, payload in new_states.items():
            v = next(u for u in path if u.top < p <= u.depth)
            if p in v.states:
                continue
            v.states[p] = State(payload, self._clock, end=p in ends, nbytes=sizes[p])
            self._m["bytes_end_states" if p in ends else "bytes_checkpoints"] += sizes[p]
            self._notify("stored", "state", v, p)
        if add_logits and leaf is not None and length not in leaf.logits:
            leaf.logits[length] = logits
            leaf.logits_nbytes[length] = logits_size
            self._m["bytes_logits"] += logits_size
        for v in path:
            v.last_access = self._clock
        self._m["peak_bytes"] = max(self._m["peak_bytes"], self.used_bytes)
        self._version += 1
        return True

    def _stamp(self, txn: Txn) -> None:
        """Tree placement: apply the request's re-plan, unless other commits changed the tree since."""
        if txn.stamps and txn.version == self._version:
            tree_plan.stamp(txn.stamps)

    def _sizeof(self, payload: Any, default: int) -> int:
        return default if self._sizer is None else int(self._sizer(payload))

    def _state_bytes(self, path: list[Node], p: int) -> int:
        s = self._find_state(path, p)
        return s.nbytes if s is not None else 0

    def _state_clock(self, path: list[Node], p: int) -> int:
        s = self._find_state(path, p)
        return s.last_access if s is not None else 0

    def _drop_state(self, path: list[Node], p: int) -> None:
        for v in path:
            if p in v.states and v.top < p <= v.depth:
                s = v.states.pop(p)
                self._m["bytes_end_states" if s.end else "bytes_checkpoints"] -= s.nbytes
                self._notify("evicted", "state", v, p)
                return

    def _notify(self, event: str, kind: str, v: Node, end: int, start: int = 0) -> None:
        """Tell the observer about the KV of ``v``'s path in ``[start, end)`` or the state after ``end``."""
        if self._observer is None:
            return
        edges: list[tuple[int, ...]] = []
        u: Node | None = v
        while u is not None and u.parent is not None:
            edges.append(u.edge)
            u = u.parent
        tokens = tuple(t for e in reversed(edges) for t in e)[:end]
        self._observer(event, kind, tokens, start)

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
                    self._notify("stored", "kv", leaf, n, pos)
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
        for name in ("states", "logits", "logits_nbytes", "mass"):
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
