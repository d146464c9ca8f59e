"""RadixIndex against a brute-force longest-common-prefix oracle."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvstate.prefix.radix import EntryId, RadixIndex


def _lcp(a, b):
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _oracle(entries, query):
    return {e: _lcp(toks, query) for e, toks in entries.items() if _lcp(toks, query) > 0}


seqs = st.lists(st.integers(0, 3), min_size=1, max_size=12)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.booleans(), seqs), min_size=1, max_size=25), seqs)
def test_overlaps_match_brute_force_under_inserts_and_removes(ops, query):
    index, live, next_id = RadixIndex(), {}, 1
    for remove, toks in ops:
        if remove and live:
            victim = sorted(live)[len(toks) % len(live)]
            index.remove(victim)
            del live[victim]
        else:
            eid = EntryId(next_id)
            next_id += 1
            index.insert(eid, toks)
            live[eid] = tuple(toks)
        assert len(index) == len(live)
        assert index.overlaps(query) == _oracle(live, query)


def test_hand_case():
    index = RadixIndex()
    index.insert(EntryId(1), [1, 2, 3, 4])
    index.insert(EntryId(2), [1, 2, 5])
    index.insert(EntryId(3), [1, 2])
    index.insert(EntryId(4), [9])
    assert index.overlaps([1, 2, 3, 7]) == {1: 3, 2: 2, 3: 2}
    assert index.overlaps([1, 2, 5, 6, 7]) == {1: 2, 2: 3, 3: 2}
    assert index.overlaps([8]) == {}
    index.remove(EntryId(3))
    assert index.overlaps([1, 2]) == {1: 2, 2: 2}
