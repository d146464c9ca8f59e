"""Bookkeeping of the sparse prefix store: entries, checkpoints, byte budget, histograms (pure).

Seed 000, SPEC §1 "Implementation": each cached entry keeps the *dense* attention KV of its tokens and
recurrent state only at sparse planned positions plus after its last token. Tensors are opaque payloads
here (the engine owns them); this module decides what is valid, what to capture, and what to evict:

- ``lookup`` returns the deepest position where both attention KV and a recurrent state are valid — never
  an attention hit past the usable checkpoint — and counts tokens lost to a missing checkpoint;
- each entry has an overlap histogram; when it drifts (total variation above a threshold since the last
  plan) the entry is re-planned: checkpoints off the new plan are dropped, new positions become *pending*
  and are captured the next time a request computes those tokens;
- the byte budget is global; eviction drops whole entries or single checkpoints (``eviction.py``); an
  entry is admitted whole or not at all.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvstate.errors import BudgetError
from kvstate.prefix.eviction import Policy, Unit, eviction_order
from kvstate.prefix.histogram import OverlapHistogram, total_variation
from kvstate.prefix.placement import expected_recompute
from kvstate.prefix.radix import EntryId, RadixIndex

Planner = Callable[[np.ndarray, int], list[int]]  # (weights over depths 0..L, L) → positions in 1..L-1


@dataclass
class Entry:
    id: EntryId
    tokens: tuple[int, ...]
    kv: Any  # opaque attention-KV payload covering all tokens (None for pure-SSM models)
    kv_bytes: int
    final: Any  # opaque recurrent state after the first L-1 tokens (None for attention-only models)
    final_logits: Any  # logits of the last position: a full hit restores L-1 tokens and computes nothing
    final_bytes: int
    checkpoints: dict[int, Any] = field(default_factory=dict)  # sparse position → opaque recurrent payload
    checkpoint_used: dict[int, int] = field(default_factory=dict)  # position → clock of last use
    planned: list[int] = field(default_factory=list)  # positions the current plan wants (< len(tokens))
    histogram: OverlapHistogram | None = None
    planned_weights: np.ndarray | None = None  # histogram weights the current plan was made from
    last_access: int = 0

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def pending(self) -> list[int]:
        return [p for p in self.planned if p not in self.checkpoints]


@dataclass(frozen=True)
class Hit:
    entry: EntryId
    position: int  # restore the state after this many tokens (0: no hit)
    overlap: int  # tokens the request shares with the entry
    lost: int  # tokens the attention KV covered but no recurrent state did
    full: bool  # position == len(entry) == len(request): logits are stored, nothing to compute


@dataclass
class StoreMetrics:
    requests: int = 0
    hits: int = 0
    tokens_reused: int = 0
    tokens_recomputed: int = 0
    tokens_lost_to_missing_checkpoint: int = 0
    evicted_entries: int = 0
    evicted_checkpoints: int = 0
    rejected_admissions: int = 0
    replans: int = 0


@dataclass(frozen=True)
class StoreConfig:
    budget_bytes: int  # global byte budget over KV + checkpoints + final states
    slots_per_entry: int = 8  # sparse checkpoints per entry (the final state is extra)
    checkpoint_bytes: int = 0  # bytes of one recurrent checkpoint (0: attention-only model)
    kv_bytes_per_token: int = 0  # attention KV bytes per token (0: pure SSM)
    has_recurrent: bool = True
    has_attention: bool = True
    policy: Policy = Policy.LRU
    alpha: float = 1.0  # utility policy weight of FLOP efficiency
    flops_per_token: float = 1.0  # recompute cost of one token (≈ 2 × parameters)
    drift_threshold: float = 0.2  # TV distance that triggers a re-plan
    gamma: float = 0.98  # histogram decay per observation (SPEC Theorem 4)

    def __post_init__(self) -> None:
        if self.slots_per_entry < 0:
            raise BudgetError(f"slots_per_entry={self.slots_per_entry} must be >= 0.")
        if self.budget_bytes <= 0:
            raise BudgetError(f"budget_bytes={self.budget_bytes} must be positive.")
        if self.has_recurrent and self.budget_bytes < self.checkpoint_bytes:
            raise BudgetError(
                f"budget_bytes={self.budget_bytes:,} is smaller than one recurrent checkpoint, which needs "
                f"{self.checkpoint_bytes:,} bytes; raise the budget to at least that."
            )
        if not 0.0 <= self.drift_threshold <= 1.0:
            raise BudgetError(f"drift_threshold={self.drift_threshold} must be in [0, 1].")
        if not 0.0 < self.gamma <= 1.0:
            raise BudgetError(f"gamma={self.gamma} must be in (0, 1].")


class PrefixStore:
    """Entries indexed by a radix tree, under one byte budget. Not thread-safe: the engine locks."""

    def __init__(self, config: StoreConfig, planner: Planner) -> None:
        self.config = config
        self._planner = planner
        self._index = RadixIndex()
        self._entries: dict[EntryId, Entry] = {}
        self._ids = itertools.count(1)
        self._clock = 0
        self.metrics = StoreMetrics()

    # -- queries ---------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._entries)

    def entry(self, entry: EntryId) -> Entry:
        return self._entries[entry]

    def entries(self) -> list[Entry]:
        return list(self._entries.values())

    @property
    def used_bytes(self) -> int:
        return sum(self._entry_bytes(e) for e in self._entries.values())

    def bytes_by_kind(self) -> dict[str, int]:
        es = self._entries.values()
        return {
            "attention_kv": sum(e.kv_bytes for e in es),
            "checkpoints": sum(len(e.checkpoints) * self.config.checkpoint_bytes for e in es),
            "final_states": sum(e.final_bytes for e in es),
        }

    def _entry_bytes(self, e: Entry) -> int:
        return e.kv_bytes + e.final_bytes + len(e.checkpoints) * self.config.checkpoint_bytes

    def usable(self, e: Entry, overlap: int, request_len: int) -> tuple[int, bool]:
        """Deepest restorable position for a request sharing ``overlap`` tokens, and whether it is full."""
        if overlap == e.length == request_len and e.final_logits is not None:
            return overlap, True
        # the restored cache must stop before the request's last token (model.generate feeds that token)
        limit = min(overlap, request_len - 1)
        if not self.config.has_recurrent:
            return limit, False  # attention KV is valid at every position
        states = [p for p in e.checkpoints if p <= limit]
        if 0 < e.length - 1 <= limit:
            states.append(e.length - 1)  # the final state
        return (max(states) if states else 0), False

    def lookup(self, tokens: tuple[int, ...]) -> Hit | None:
        best: Hit | None = None
        for eid, overlap in self._index.overlaps(tokens).items():
            e = self._entries[eid]
            pos, full = self.usable(e, overlap, len(tokens))
            if pos == 0:
                continue
            lost = (min(overlap, len(tokens) - 1) - pos) if not full else 0
            hit = Hit(eid, pos, overlap, max(lost, 0), full)
            if best is None or (hit.position, -hit.lost) > (best.position, -best.lost):
                best = hit
        return best

    # -- request accounting ----------------------------------------------------------------------
    def tick(self) -> int:
        self._clock += 1
        return self._clock

    def record_request(self, tokens: tuple[int, ...], hit: Hit | None, computed: int) -> None:
        """Count a served request, touch what it used, and feed the overlap histogram of every entry it
        overlaps (re-planning those that drifted)."""
        m = self.metrics
        m.requests += 1
        m.tokens_recomputed += computed
        if hit is not None:
            m.hits += 1
            m.tokens_reused += hit.position
            m.tokens_lost_to_missing_checkpoint += hit.lost
            e = self._entries[hit.entry]
            e.last_access = self._clock
            if hit.position in e.checkpoints:
                e.checkpoint_used[hit.position] = self._clock
        for eid, overlap in self._index.overlaps(tokens).items():
            e = self._entries[eid]
            if e.histogram is not None:
                e.histogram.record(min(overlap, e.length))
                self._maybe_replan(e)

    def _plan(self, e: Entry, weights: np.ndarray) -> None:
        if not self.config.has_recurrent or self.config.slots_per_entry == 0 or e.length < 2:
            e.planned = []
        else:
            e.planned = [p for p in self._planner(weights, e.length) if 0 < p < e.length]
        e.planned_weights = weights
        for p in list(e.checkpoints):
            if p not in e.planned:
                del e.checkpoints[p]
                e.checkpoint_used.pop(p, None)

    def _maybe_replan(self, e: Entry) -> None:
        assert e.histogram is not None
        w = e.histogram.weights()
        if e.planned_weights is None or total_variation(w, e.planned_weights) > self.config.drift_threshold:
            self._plan(e, w)
            self.metrics.replans += 1

    # -- capture and admission -------------------------------------------------------------------
    def wanted_positions(self, tokens: tuple[int, ...], start: int, hit: Hit | None, prior: np.ndarray | None) -> list[int]:
        """Positions in (start, len) whose state this request should capture: the plan of the entry it
        will become, plus pending positions (re-planned, not yet captured) of every entry it overlaps."""
        n = len(tokens)
        want = {p for p in self.plan_for_new(tokens, hit, prior) if start < p < n}
        for pending in self._pending_on_path(tokens).values():
            want |= {p for p in pending if start < p < n}
        return sorted(want)

    def _pending_on_path(self, tokens: tuple[int, ...]) -> dict[EntryId, list[int]]:
        out = {}
        for eid, overlap in self._index.overlaps(tokens).items():
            pending = [p for p in self._entries[eid].pending if p <= overlap]
            if pending:
                out[eid] = pending
        return out

    def plan_for_new(self, tokens: tuple[int, ...], hit: Hit | None, prior: np.ndarray | None) -> list[int]:
        n = len(tokens)
        if not self.config.has_recurrent or self.config.slots_per_entry == 0 or n < 2:
            return []
        return [p for p in self._planner(self._new_weights(tokens, hit, prior), n) if 0 < p < n]

    def _new_weights(self, tokens: tuple[int, ...], hit: Hit | None, prior: np.ndarray | None) -> np.ndarray:
        """An entry that extends another inherits its overlap history; a new one starts from the store's."""
        parent = self._extended_entry(tokens, hit)
        if parent is not None and parent.histogram is not None:
            w = parent.histogram.weights()
            if w.sum() > 0:
                return self._weights(w, len(tokens))
        return self._weights(prior, len(tokens))

    def _weights(self, prior: np.ndarray | None, n: int) -> np.ndarray:
        if prior is None or prior.sum() <= 0:
            return np.ones(n + 1)
        w = np.zeros(n + 1)
        k = min(len(prior), n + 1)
        w[:k] = prior[:k]
        w[n] += prior[k:].sum()  # deeper overlaps are capped at this entry's length
        return w if w.sum() > 0 else np.ones(n + 1)

    def _extended_entry(self, tokens: tuple[int, ...], hit: Hit | None) -> Entry | None:
        """The hit entry if the request extends it exactly (append-only chat): it is replaced, not copied."""
        if hit is None:
            return None
        e = self._entries[hit.entry]
        return e if hit.overlap == e.length and len(tokens) > e.length else None

    def attach_captures(self, tokens: tuple[int, ...], captured: dict[int, Any]) -> None:
        """Give every overlapping entry the states of its pending positions this request computed."""
        for eid, pending in self._pending_on_path(tokens).items():
            for p in pending:
                e = self._entries.get(eid)
                if e is None or p not in captured:
                    continue  # evicted while making room, or not computed by this request
                self._make_room(self.config.checkpoint_bytes, protect=eid)
                if self.used_bytes + self.config.checkpoint_bytes <= self.config.budget_bytes:
                    e.checkpoints[p] = captured[p]
                    e.checkpoint_used[p] = self._clock

    def admit(
        self,
        tokens: tuple[int, ...],
        hit: Hit | None,
        kv: Any,
        final: Any,
        final_logits: Any,
        captured: dict[int, Any],
        prior: np.ndarray | None,
    ) -> EntryId | None:
        """Insert the request as an entry (replacing the entry it extends). Whole or nothing."""
        n = len(tokens)
        if any(e.tokens == tokens for e in self._entries.values()):
            return None
        parent = self._extended_entry(tokens, hit)
        plan = self.plan_for_new(tokens, hit, prior)
        weights = self._new_weights(tokens, hit, prior)  # before the parent is replaced
        available = dict(captured)
        if parent is not None:  # its checkpoints and final state lie on the new entry's path
            available = {**parent.checkpoints, parent.length - 1: parent.final, **available}
        checkpoints = {p: available[p] for p in plan if p in available}
        kv_bytes = n * self.config.kv_bytes_per_token if self.config.has_attention else 0
        final_bytes = self.config.checkpoint_bytes if self.config.has_recurrent else 0
        need = kv_bytes + final_bytes + len(checkpoints) * self.config.checkpoint_bytes
        freed_parent = self._entry_bytes(parent) if parent is not None else 0
        if need > self.config.budget_bytes:
            # drop sparse checkpoints (deepest last) until the entry fits; never a partial KV
            keep = sorted(checkpoints)
            while keep and need > self.config.budget_bytes:
                keep.pop(0)
                need -= self.config.checkpoint_bytes
            checkpoints = {p: checkpoints[p] for p in keep}
            if need > self.config.budget_bytes:
                self.metrics.rejected_admissions += 1
                return None
        self._make_room(need - freed_parent, protect=parent.id if parent else None)
        if self.used_bytes - freed_parent + need > self.config.budget_bytes:
            self.metrics.rejected_admissions += 1
            return None
        hist = OverlapHistogram(n, gamma=self.config.gamma)
        if parent is not None:
            hist = parent.histogram.extended(n) if parent.histogram is not None else hist
            self._remove(parent.id)
        eid = EntryId(next(self._ids))
        e = Entry(eid, tokens, kv, kv_bytes, final, final_logits, final_bytes, histogram=hist, last_access=self._clock)
        e.planned = plan
        e.planned_weights = weights
        e.checkpoints = checkpoints
        e.checkpoint_used = dict.fromkeys(checkpoints, self._clock)
        self._entries[eid] = e
        self._index.insert(eid, tokens)
        return eid

    # -- eviction --------------------------------------------------------------------------------
    def _units(self, protect: EntryId | None) -> list[Unit]:
        units = []
        for e in self._entries.values():
            if e.id == protect:
                continue
            w = e.histogram.weights() if e.histogram is not None else None
            mass = float(w.sum()) if w is not None else 1.0
            positions = sorted(e.checkpoints)
            base = _expected(w, [*positions, e.length]) if w is not None else 0.0
            for p in positions:
                without = _expected(w, [q for q in positions if q != p] + [e.length]) if w is not None else 0.0
                units.append(Unit(e.id, p, self.config.checkpoint_bytes, e.checkpoint_used.get(p, e.last_access),
                                  (without - base) * mass))
            reused = (float(np.dot(w, np.arange(len(w)))) / max(mass, 1e-12) - base) * mass if w is not None else 0.0
            units.append(Unit(e.id, None, self._entry_bytes(e), e.last_access, max(reused, 0.0)))
        return units

    def _make_room(self, need: int, protect: EntryId | None) -> None:
        while self.used_bytes + need > self.config.budget_bytes:
            order = eviction_order(self._units(protect), self.config.policy, self.config.flops_per_token, self.config.alpha)
            if not order:
                return
            victim = order[0]
            if victim.position is None:
                self._remove(EntryId(victim.entry))
                self.metrics.evicted_entries += 1
            else:
                e = self._entries[EntryId(victim.entry)]
                del e.checkpoints[victim.position]
                e.checkpoint_used.pop(victim.position, None)
                self.metrics.evicted_checkpoints += 1

    def _remove(self, eid: EntryId) -> None:
        del self._entries[eid]
        self._index.remove(eid)


def _expected(w: np.ndarray | None, positions: list[int]) -> float:
    if w is None or w.sum() <= 0:
        return 0.0
    return expected_recompute(w, sorted(set(p for p in positions if 0 < p < len(w))))
