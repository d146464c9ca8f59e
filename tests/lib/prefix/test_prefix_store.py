"""The radix prefix store (pure): transactions, shared KV, learning, eviction — against brute-force models."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstate.errors import BudgetError
from kvstate.prefix.eviction import Policy
from kvstate.prefix.placement import plan_checkpoints
from kvstate.prefix.store import PrefixStore, StoreConfig

CK, KVT, LOG = 10, 1, 2  # bytes: one recurrent state, KV per token, one logits row


def _planner(slots: int, align: int):
    def plan(w, n):
        return [] if n <= align else plan_checkpoints(w, slots, "optimal", align)

    return plan


def _store(budget: int, slots: int = 2, align: int = 4, policy: Policy = Policy.LRU) -> PrefixStore:
    cfg = StoreConfig(budget, slots, CK, KVT, LOG, policy=policy)
    return PrefixStore(cfg, _planner(slots, align), splitter=lambda kv, k: (kv[:k], kv[k:]))


def _serve(store: PrefixStore, tokens: tuple[int, ...]):
    """A request end to end with fake payloads: KV payload = the token tuple, state = ("S", position)."""
    txn = store.begin(tokens)
    if txn.hit.full:
        store.abort(txn)
        return txn, True
    ok = store.commit(txn, {p: ("S", p) for p in txn.capture}, lambda a, b: tokens[a:b], ("L", len(tokens)))
    return txn, ok


def _real_bytes(store: PrefixStore) -> int:
    c = store.config
    return sum(
        len(v.kv) * KVT + len(v.states) * c.checkpoint_bytes + len(v.logits) * LOG for v in store.nodes()
    )


def _check_invariants(store: PrefixStore) -> None:
    assert store.used_bytes == _real_bytes(store) <= store.config.budget_bytes
    for v in store.nodes():
        assert v.kv == v.edge  # each node holds exactly its own tokens' KV (one copy)
        assert all(v.top < p <= v.depth for p in v.states)  # no orphan: every state sits on its node's edge
        assert all(v.top < d <= v.depth for d in v.logits)
        parent = v.parent
        assert parent is not None and parent.children[v.edge[0]] is v


@pytest.mark.parametrize("policy", list(Policy))
def test_commit_never_evicts_the_path_it_resumed_from(policy):
    """Regression: the old store evicted the entry just hit while making room and then raised KeyError."""
    a = tuple(range(1, 17))
    b = tuple(range(101, 117))
    store = _store(budget=97, slots=2, align=4, policy=policy)  # A and B fill it: the commit must evict
    _serve(store, a)
    _serve(store, b)
    assert store.used_bytes > 97 - 3
    txn = store.begin((*a[:15], 2))
    assert txn.hit.position > 0 and txn.hit.overlap == 15
    assert store.commit(txn, {p: ("S", p) for p in txn.capture}, lambda x, y: ((*a[:15], 2))[x:y], ("L", 16))
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
    txn = store.begin(big)
    before = _shape(store)
    assert not store.commit(txn, {p: ("S", p) for p in txn.capture}, lambda a, b: big[a:b], ("L", len(big)))
    assert store.metrics().rejected_inserts == 1 and _shape(store) == before
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


class StoreMachine(RuleBasedStateMachine):
    """Random request / insert / pin / unpin sequences under pressure, both policies."""

    def __init__(self) -> None:
        super().__init__()
        self.store: PrefixStore | None = None
        self.pins: list[tuple[int, ...]] = []
        self.docs = [tuple(range(1 + 50 * d, 31 + 50 * d)) for d in range(3)]

    @precondition(lambda self: self.store is None)
    @rule(policy=st.sampled_from(list(Policy)), budget=st.integers(60, 200), slots=st.integers(0, 3))
    def create(self, policy, budget, slots):
        self.store = _store(budget, slots, align=4, policy=policy)

    @precondition(lambda self: self.store is not None)
    @rule(doc=st.integers(0, 2), cut=st.integers(1, 30), tail=st.lists(st.integers(900, 910), max_size=4))
    def request(self, doc, cut, tail):
        tokens = self.docs[doc][:cut] + tuple(tail)
        before = self.store.lookup(tokens)
        txn, _ = _serve(self.store, tokens)
        assert txn.hit == before
        # every hit restores a position whose KV and state exist on the request's own path
        if txn.hit.position and not txn.hit.full:
            assert txn.state == ("S", txn.hit.position)
            assert sum(take for _, take in txn.kv) == txn.hit.position
            assert tuple(t for seg, take in txn.kv for t in seg[:take]) == tokens[: txn.hit.position]

    @precondition(lambda self: self.store is not None)
    @rule(doc=st.integers(0, 2), cut=st.integers(2, 30))
    def insert(self, doc, cut):
        tokens = self.docs[doc][:cut]
        txn = self.store.begin(tokens, serving=False)
        self.store.commit(txn, {cut - 1: ("S", cut - 1)}, lambda a, b: tokens[a:b], None, cut - 1)

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
