"""The radix prefix store (pure): transactions, shared KV, learning, eviction — against brute-force models."""

from __future__ import annotations

import itertools
import logging
import math

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstate.errors import BudgetError, KVStateError
from kvstate.prefix.eviction import Policy
from kvstate.prefix.placement import expected_recompute, plan_among, plan_checkpoints
from kvstate.prefix.store import NO_REUSE_WARN_AFTER, PrefixStore, StoreConfig

CK, KVT, LOG = 10, 1, 2  # bytes: one recurrent state (estimate), KV per token, one logits row


def _planner(slots: int, align: int):
    def plan(w, n):
        return [] if n <= align else plan_checkpoints(w, slots, "optimal", align)

    return plan


def _state(tokens: tuple[int, ...], p: int):
    """A fake recurrent state: its position and the branch it was taken on (the tokens before it)."""
    return ("S", p, tokens[:p])


def _size(payload) -> int:
    """Bytes of a fake payload: states of three sizes (as dtypes differ), logits rows of LOG."""
    return CK + payload[1] % 3 if payload[0] == "S" else LOG


def _store(budget: int, slots: int = 2, align: int = 4, policy: Policy = Policy.LRU, **kw) -> PrefixStore:
    cfg = StoreConfig(budget, slots, CK, KVT, LOG, policy=policy, **kw)
    return PrefixStore(cfg, _planner(slots, align), splitter=lambda kv, k: (kv[:k], kv[k:]), sizer=_size)


def _serve(store: PrefixStore, tokens: tuple[int, ...], boundaries: tuple[int, ...] = ()):
    """A request end to end with fake payloads: KV payload = the token tuple, states from ``_state``; a full
    hit commits nothing new (it still teaches the store its overlap and clocks)."""
    txn = store.begin(tokens, boundaries=boundaries)
    if txn.hit.full:
        return txn, store.commit(txn, {}, None)
    states = {p: _state(tokens, p) for p in txn.capture}
    ok = store.commit(txn, states, lambda a, b: tokens[a:b], ("L", tokens))
    return txn, ok


def _prefix(v) -> tuple[int, ...]:
    """The tokens from the root to the end of ``v``'s edge."""
    edges = []
    while v.parent is not None:
        edges.append(v.edge)
        v = v.parent
    return tuple(t for e in reversed(edges) for t in e)


def _real_bytes(store: PrefixStore) -> int:
    return sum(
        len(v.kv) * KVT + sum(_size(s.payload) for s in v.states.values()) + sum(_size(x) for x in v.logits.values())
        for v in store.nodes()
    )


def _check_invariants(store: PrefixStore) -> None:
    assert store.used_bytes == _real_bytes(store) <= store.config.budget_bytes
    for v in store.nodes():
        assert v.kv == v.edge  # each node holds exactly its own tokens' KV (one copy)
        assert all(v.top < p <= v.depth for p in v.states)  # no orphan: every state sits on its node's edge
        assert all(v.top < d <= v.depth for d in v.logits)
        prefix = _prefix(v)
        # every state and logits row belongs to the branch it sits on, not only to its depth
        assert all(s.payload == _state(prefix, p) for p, s in v.states.items())
        assert all(x == ("L", prefix[:d]) for d, x in v.logits.items())
        parent = v.parent
        assert parent is not None and parent.children[v.edge[0]] is v


def _learned(store: PrefixStore, metrics: bool = True):
    """Everything a request could change: the tree, states, overlap counts, clocks, plan stamps (and metrics)."""
    nodes = sorted(
        (
            v.id, v.edge, v.depth, v.kv, v.pins, v.last_access, v.sub_mass, sorted(v.mass.items()),
            sorted((p, s.payload, s.last_access, s.end, s.nbytes) for p, s in v.states.items()),
            sorted(v.logits.items()), sorted(v.logits_nbytes.items()),
            sorted(v.planned), v.plan_sub, v.plan_own,
        )
        for v in store.nodes()
    )
    out = (nodes, store.root.sub_mass, store._clock, sorted(store._prior.items()), sorted(store._tails.items()),
           store.used_bytes)
    return (*out, store.metrics()) if metrics else out


@pytest.mark.parametrize("policy", list(Policy))
def test_commit_never_evicts_the_path_it_resumed_from(policy):
    """Regression: the old store evicted the entry just hit while making room and then raised KeyError."""
    a = tuple(range(1, 17))
    b = tuple(range(101, 117))
    probe = _store(budget=10**6, slots=2, align=4, policy=policy)
    _serve(probe, a)
    _serve(probe, b)
    budget = probe.used_bytes + 3
    store = _store(budget=budget, slots=2, align=4, policy=policy)  # A and B fill it: the commit must evict
    _serve(store, a)
    _serve(store, b)
    assert store.used_bytes == budget - 3
    txn = store.begin((*a[:15], 2))
    assert txn.hit.position > 0 and txn.hit.overlap == 15
    req = (*a[:15], 2)
    assert store.commit(txn, {p: _state(req, p) for p in txn.capture}, lambda x, y: req[x:y], ("L", req))
    _check_invariants(store)
    _path, t = store._walk((*a[:15], 2))
    assert t == 16  # the request is stored; what it resumed from is still there
    assert store.lookup((*a[:15], 2)).full


def _shape(store: PrefixStore):
    return store.used_bytes, sorted((v.edge, sorted(v.states), sorted(v.logits), v.kv) for v in store.nodes())


def test_a_commit_that_cannot_fit_leaves_the_store_unchanged():
    store = _store(budget=60, slots=1)
    doc = tuple(range(1, 21))
    _serve(store, doc)
    big = doc[:5] + tuple(range(200, 260))  # shares 5 tokens: a fitting commit would split doc's edge
    before, learned = _shape(store), _learned(store, metrics=False)
    txn = store.begin(big)
    assert not store.commit(txn, {p: _state(big, p) for p in txn.capture}, lambda a, b: big[a:b], ("L", big))
    assert store.metrics().rejected_inserts == 1 and _shape(store) == before
    # nothing learned from a request that was not stored: overlap counts, clocks, stamps as they were
    assert _learned(store, metrics=False) == learned
    m = store.metrics()
    assert m.requests == 2 and m.tokens_total == len(doc) + len(big)  # served all the same
    _check_invariants(store)


def test_second_request_captures_where_the_overlap_is_and_third_resumes_there():
    store = _store(budget=10_000, slots=1, align=4)
    doc = tuple(range(1, 41))
    q = [(*doc, 200 + i, 300 + i) for i in range(3)]
    _serve(store, q[0])
    second, _ = _serve(store, q[1])
    assert second.hit.overlap == 40 and 40 in second.capture  # planned before the pass, from the true overlap
    third, _ = _serve(store, q[2])
    assert third.hit.position == 40 and third.hit.lost == 0
    _check_invariants(store)


def test_documents_are_stored_once_however_many_requests_extend_them():
    store = _store(budget=10_000, slots=2)
    doc = tuple(range(1, 101))
    for i in range(6):
        _serve(store, (*doc, 500 + i, 600 + i, 700 + i))
    assert store.bytes_by_kind()["attention_kv"] == (100 + 6 * 3) * KVT
    _check_invariants(store)


def test_end_states_never_take_a_slot_and_full_hits_compute_nothing():
    store = _store(budget=10_000, slots=1, align=4)
    sys_prompt = tuple(range(1, 102))
    for _ in range(3):
        txn, _ = _serve(store, sys_prompt)
    assert all(p < len(sys_prompt) - 1 for p in txn.plan)
    assert store.lookup(sys_prompt).full and store.metrics().tokens_reused >= 2 * len(sys_prompt)


def test_pinned_prefix_survives_pressure_and_unpin_releases_it():
    store = _store(budget=120, slots=1)
    sys_prompt = tuple(range(1, 31))
    _serve(store, sys_prompt)
    store.pin(sys_prompt)
    for d in range(6):
        _serve(store, tuple(range(1000 + 40 * d, 1030 + 40 * d)))
        assert store.lookup(sys_prompt).overlap == 30
    store.unpin(sys_prompt)
    with pytest.raises(BudgetError, match="not pinned"):
        store.unpin(sys_prompt)
    with pytest.raises(BudgetError, match="insert the prefix first"):
        store.pin(tuple(range(5000, 5010)))
    _check_invariants(store)


def test_metrics_are_immutable_snapshots_and_reset():
    store = _store(budget=10_000)
    _serve(store, (1, 2, 3, 4, 5))
    snap = store.metrics()
    _serve(store, (1, 2, 3, 4, 6))
    assert snap.requests == 1 and store.metrics().requests == 2
    with pytest.raises(AttributeError):
        snap.requests = 5  # type: ignore[misc]
    store.reset_metrics()
    m = store.metrics()
    assert m.requests == 0 and m.used_bytes == store.used_bytes > 0


def test_a_commit_never_trims_a_state_of_another_branch():
    """Regression: positions past the point where a request diverged were counted as its own and dropped."""
    a = tuple(range(1, 21))
    b = (*a[:5], *range(100, 107))  # shares A's first 5 tokens
    cfg = StoreConfig(10_000, 1, CK, KVT, LOG)
    store = PrefixStore(cfg, lambda w, n: [10] if n == len(a) else [3], lambda kv, k: (kv[:k], kv[k:]), _size)
    txn, _ = _serve(store, a)
    assert 10 in txn.capture
    txn, _ = _serve(store, b)
    assert txn.plan == (3,) and 3 in txn.capture
    path, t = store._walk(a)
    assert t == len(a) and store._find_state(path, 10) is not None  # A's checkpoint survived B's commit
    assert store.lookup((*a[:15], 999)).position == 10
    assert store.lookup((*b[:4], 999)).position == 3
    _check_invariants(store)


@pytest.mark.parametrize("placement", ["path", "tree"])
def test_abort_leaves_the_store_and_what_it_learned_as_it_was(placement):
    store = _store(10_000, slots=2, align=4, placement=placement)
    doc = tuple(range(1, 41))
    for i in range(4):
        _serve(store, (*doc[: 20 + 5 * i], 500 + i, 600 + i))
    _serve(store, doc)
    before = _learned(store)
    for req in [(*doc, 700, 701), (*doc[:33], 800), doc, (*doc[:-1], 900)]:  # partial, branching, full hit
        txn = store.begin(req)
        assert txn.hit.position > 0  # it would reuse (and so touch clocks) and observe an overlap
        store.abort(txn)
        store.abort(txn)  # idempotent
        assert _learned(store) == before
    # the same request committed does learn: its overlap, the clocks, the request count
    _serve(store, (*doc, 700, 701))
    after = _learned(store)
    assert after[1] == before[1] + 1 and after[2] > before[2] and after[-1].requests == before[-1].requests + 1


def test_declared_boundary_lets_the_second_request_resume():
    store = _store(10_000, slots=1, align=16)
    doc = tuple(range(1, 41))  # 40 tokens: not on the 16-token grid
    first, _ = _serve(store, (*doc, 200, 201, 202), boundaries=(40,))
    assert 40 in first.capture and first.boundaries == (40,)
    second, _ = _serve(store, (*doc, 300, 301), boundaries=(40,))
    assert second.hit.position == 40 and second.hit.lost == 0
    # without the declaration the second request only captures where the overlap turned out to be
    plain = _store(10_000, slots=1, align=16)
    _serve(plain, (*doc, 200, 201, 202))
    assert _serve(plain, (*doc, 300, 301))[0].hit.position < 40
    _check_invariants(store)


def test_declared_boundaries_take_slots_only_while_they_pay_off():
    doc = tuple(range(1, 61))

    def trained(slots: int) -> PrefixStore:
        store = _store(10_000, slots=slots, align=4)
        for i in range(12):  # many requests part at depth 20
            _serve(store, (*doc[:20], 500 + i, 600 + i))
        return store

    txn = trained(1).begin((*doc, 700), boundaries=(50,))
    assert txn.plan == (20,) and txn.boundaries == ()  # one slot: the observed branch point wins
    txn = trained(2).begin((*doc, 700), boundaries=(50,))
    assert 50 in txn.plan and txn.boundaries == (50,) and 50 in txn.capture  # a free slot: it pays off
    txn = trained(0).begin((*doc, 700), boundaries=(50,))
    assert txn.plan == () and txn.boundaries == ()  # no slots, no boundaries
    txn = trained(2).begin((*doc, 700), boundaries=(60, 61))  # n-1 and n: the end state serves them
    assert txn.boundaries == ()


@pytest.mark.parametrize(
    ("bad", "match"),
    [((0, 5), "outside 1..10"), ((5, 11), "outside 1..10"), ((6, 4), "strictly increasing"),
     ((3, 3), "strictly increasing"), ((2.5,), "not token positions"), ((True,), "not token positions")],
)
def test_bad_boundaries_are_one_clear_error(bad, match):
    store = _store(10_000)
    with pytest.raises(KVStateError, match=match) as err:
        store.begin(tuple(range(1, 11)), boundaries=bad)
    assert "boundaries" in str(err.value) and "sorted(set(" in str(err.value)
    assert not store._open  # nothing begun


def test_lost_tokens_are_cumulative_and_overlaps_without_reuse_warn_once(caplog):
    store = _store(100_000, slots=0, align=4)  # no planned checkpoints: only end states
    doc = tuple(range(1, 41))
    _serve(store, doc)
    with caplog.at_level(logging.WARNING, logger="kvstate.prefix"):
        for i in range(NO_REUSE_WARN_AFTER + 8):  # a shared first (BOS) token is no overlap worth a warning
            _serve(store, (1, 7000 + i, 8000 + i))
        assert not caplog.records
        for i in range(NO_REUSE_WARN_AFTER - 1):
            _serve(store, (*doc[:30], 1000 + i, 2000 + i))  # overlaps 30, reuses nothing
            _serve(store, (5000 + i, 6000 + i))  # overlaps nothing: does not break the run
        assert not caplog.records
        _serve(store, (*doc[:30], 999, 998))
        for i in range(40):
            _serve(store, (*doc[:30], 3000 + i, 4000 + i))
    warned = [r for r in caplog.records if r.name == "kvstate.prefix"]
    assert len(warned) == 1 and "reused nothing" in warned[0].getMessage()
    assert store.metrics().tokens_lost_to_missing_checkpoint == 30 * (NO_REUSE_WARN_AFTER + 40) + 1 * (
        NO_REUSE_WARN_AFTER + 8
    )


def test_plan_among_equals_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(60):
        n = int(rng.integers(3, 30))
        w = rng.random(n + 1) * (rng.random(n + 1) < 0.5)
        w[0] += 0.1
        cand = sorted({int(c) for c in rng.integers(1, n + 1, int(rng.integers(1, 8)))})
        slots = int(rng.integers(0, 5))
        got = plan_among(w, cand, slots)
        assert set(got) <= set(cand) and len(got) <= slots
        best = min(
            expected_recompute(w, sub) for k in range(min(slots, len(cand)) + 1) for sub in itertools.combinations(cand, k)
        )
        assert math.isclose(expected_recompute(w, got), best, rel_tol=1e-9, abs_tol=1e-12)
        for p in got:  # every chosen point pays off
            assert expected_recompute(w, [q for q in got if q != p]) > expected_recompute(w, got) + 1e-12


class StoreMachine(RuleBasedStateMachine):
    """Random request / insert / pin / unpin / abort sequences under pressure, both policies. Fake states carry
    the branch they were taken on, so a state restored from (or trimmed off) another branch is caught."""

    def __init__(self) -> None:
        super().__init__()
        self.store: PrefixStore | None = None
        self.pins: list[tuple[int, ...]] = []
        self.docs = [tuple(range(1 + 50 * d, 31 + 50 * d)) for d in range(3)]

    @precondition(lambda self: self.store is None)
    @rule(policy=st.sampled_from(list(Policy)), budget=st.integers(60, 200), slots=st.integers(0, 3))
    def create(self, policy, budget, slots):
        self.store = _store(budget, slots, align=4, policy=policy)

    def _check_hit(self, tokens, txn):
        # every hit restores a position whose KV and state exist on the request's own path (its own branch)
        if txn.hit.full:
            n = len(tokens)
            assert txn.logits == ("L", tokens)
            assert txn.state is None if n == 1 else txn.state == _state(tokens, n - 1)
        elif txn.hit.position:
            assert txn.state == _state(tokens, txn.hit.position)
            assert sum(take for _, take in txn.kv) == txn.hit.position
            assert tuple(t for seg, take in txn.kv for t in seg[:take]) == tokens[: txn.hit.position]

    @precondition(lambda self: self.store is not None)
    @rule(
        doc=st.integers(0, 2),
        cut=st.integers(1, 30),
        tail=st.lists(st.integers(900, 910), max_size=4),
        declare=st.lists(st.integers(1, 34), max_size=3),
    )
    def request(self, doc, cut, tail, declare):
        tokens = self.docs[doc][:cut] + tuple(tail)
        boundaries = tuple(sorted({b for b in declare if b <= len(tokens)}))
        before = self.store.lookup(tokens)
        txn, _ = _serve(self.store, tokens, boundaries)
        assert txn.hit == before
        self._check_hit(tokens, txn)
        assert set(txn.boundaries) <= set(boundaries) and set(txn.boundaries) <= set(txn.plan)

    @precondition(lambda self: self.store is not None)
    @rule(doc=st.integers(0, 2), cut=st.integers(1, 30), tail=st.lists(st.integers(900, 910), max_size=4))
    def aborted_request(self, doc, cut, tail):
        """A request whose forward pass failed: the store is left exactly as it was."""
        tokens = self.docs[doc][:cut] + tuple(tail)
        before = _learned(self.store)
        txn = self.store.begin(tokens)
        self._check_hit(tokens, txn)
        self.store.abort(txn)
        assert _learned(self.store) == before

    @precondition(lambda self: self.store is not None)
    @rule(doc=st.integers(0, 2), cut=st.integers(2, 30))
    def insert(self, doc, cut):
        tokens = self.docs[doc][:cut]
        txn = self.store.begin(tokens, serving=False)
        self.store.commit(txn, {cut - 1: _state(tokens, cut - 1)}, lambda a, b: tokens[a:b], None, cut - 1)

    @precondition(lambda self: self.store is not None)
    @rule(doc=st.integers(0, 2), cut=st.integers(1, 10))
    def pin(self, doc, cut):
        tokens = self.docs[doc][:cut]
        if self.store.lookup(tokens).overlap == cut and len(self.pins) < 2:
            self.store.pin(tokens)
            self.pins.append(tokens)

    @precondition(lambda self: self.store is not None and bool(self.pins))
    @rule()
    def unpin(self):
        self.store.unpin(self.pins.pop())

    @invariant()
    def consistent(self):
        if self.store is not None:
            _check_invariants(self.store)
            for tokens in self.pins:
                assert self.store.lookup(tokens).overlap == len(tokens)  # pinned prefixes are never evicted
            assert not self.store._open  # every transaction closed
            # no transaction left a pin behind: every pin count is a user pin
            held = [u for nodes in self.store._user_pins.values() for u in nodes]
            assert len(held) == len(self.pins)
            assert all(v.pins == sum(u is v for u in held) for v in self.store.nodes())


StoreMachine.TestCase.settings = settings(max_examples=30, stateful_step_count=20, deadline=None)
test_store_state_machine = StoreMachine.TestCase
