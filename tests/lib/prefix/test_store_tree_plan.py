"""Tree placement inside the radix store (pure): the exact DP on the store's subtree vs brute force."""

from __future__ import annotations

import itertools
import math
import random

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from kvstate.prefix.eviction import Policy
from kvstate.prefix.store import PrefixStore, StoreConfig
from kvstate.prefix.tree_placement import tree_expected_recompute
from kvstate.prefix.tree_plan import TreeLimits, needs_plan, solve
from tests.lib.prefix.test_prefix_store import StoreMachine, _size, _state

CK, KVT, LOG = 10, 1, 2


def _store(slots: int, align: int, limits: TreeLimits = TreeLimits()) -> PrefixStore:
    cfg = StoreConfig(10**9, slots, CK, KVT, LOG, placement="tree", align=align, tree=limits)
    return PrefixStore(cfg, lambda w, n: [], splitter=lambda kv, k: (kv[:k], kv[k:]))


def _serve(store: PrefixStore, tokens: tuple[int, ...]):
    txn = store.begin(tokens)
    if txn.hit.full:
        store.commit(txn, {}, None)
        return txn
    store.commit(txn, {p: _state(tokens, p) for p in txn.capture}, lambda a, b: tokens[a:b], ("L", tokens))
    return txn


def _brute_force(tree, slots: int, align: int) -> float:
    points = [
        (v, c) for v in range(1, tree.size) for c in range(tree.top[v] + 1, tree.end(v) + 1) if c % align == 0
    ]
    best = tree_expected_recompute(tree, [])
    for k in range(1, min(slots, len(points)) + 1):
        for chosen in itertools.combinations(points, k):
            best = min(best, tree_expected_recompute(tree, list(chosen)))
    return best


def test_store_tree_placement_equals_brute_force_on_small_trees():
    rng = random.Random(0)
    checked = placed = 0
    for case in range(40):
        align = rng.choice([1, 2, 3])
        limits = TreeLimits(max_nodes=rng.choice([3, 5, 32]), max_slots=rng.choice([1, 2, 3]), max_grid=64)
        store = _store(slots=rng.choice([1, 2]), align=align, limits=limits)
        docs = [tuple(rng.randrange(1, 4) for _ in range(rng.randrange(2, 6))) for _ in range(3)]
        for _ in range(rng.randrange(1, 6)):
            d = rng.choice(docs)
            _serve(store, d[: rng.randrange(1, len(d) + 1)] + tuple(rng.randrange(1, 4) for _ in range(2)))
        req = (*rng.choice(docs), 9)
        path, t = store._walk(req)
        built = store.tree_for(path, t, len(req))
        # the root, the path (always), neighbours up to the cap; the cut and the new part add at most two
        assert built.tree.size <= max(limits.max_nodes, len(path) + 1) + 2
        got = solve(built)
        assert len(got) <= built.slots <= limits.max_slots
        assert all(c % built.align == 0 for _, c in got)
        # the engine's plan equals brute force on the same tree, slots and grid
        want = _brute_force(built.tree, built.slots, built.align)
        assert math.isclose(tree_expected_recompute(built.tree, got), want, rel_tol=1e-9, abs_tol=1e-12), case
        # the tree carries every observation the store made (collapsed or not)
        total = built.tree.root_mass + sum(float(m.sum()) for m in built.tree.mass)
        assert total <= store.root.sub_mass + 1.0 + 1e-9
        checked += 1
        placed += len(got)
    assert checked == 40 and placed >= 10  # not only trivial (empty) plans


def test_tree_placement_learns_second_captures_third_resumes():
    store = _store(slots=1, align=4)
    doc = tuple(range(1, 41))
    q = [(*doc, 200 + i, 300 + i) for i in range(3)]
    _serve(store, q[0])
    second = _serve(store, q[1])
    assert second.hit.overlap == 40 and second.replanned and 40 in second.capture
    third = _serve(store, q[2])
    assert third.hit.position == 40 and third.hit.lost == 0


def test_replans_only_on_drift_of_the_request_path():
    store = _store(slots=2, align=4)
    doc = tuple(range(1, 41))
    _serve(store, (*doc, 500))
    _serve(store, (*doc, 501))
    _serve(store, (*doc, 502))
    replans = [_serve(store, (*doc, 600 + i, 700 + i)).replanned for i in range(20)]
    assert replans.count(True) <= 6 and not all(replans[10:])  # most requests reuse the standing plan
    path, _ = store._walk((*doc, 999))
    assert not needs_plan(path, 40, 1.0)  # drift 1.0 never triggers on a stamped path


class TreeStoreMachine(StoreMachine):
    """The random request / insert / pin sequences of ``test_prefix_store`` under tree placement."""

    @precondition(lambda self: self.store is None)
    @rule(policy=st.sampled_from(list(Policy)), budget=st.integers(60, 200), slots=st.integers(0, 3))
    def create(self, policy, budget, slots):
        cfg = StoreConfig(budget, slots, CK, KVT, LOG, policy=policy, placement="tree", align=4)
        self.store = PrefixStore(cfg, lambda w, n: [], splitter=lambda kv, k: (kv[:k], kv[k:]), sizer=_size)


TreeStoreMachine.TestCase.settings = settings(max_examples=30, stateful_step_count=20, deadline=None)
test_tree_store_state_machine = TreeStoreMachine.TestCase
