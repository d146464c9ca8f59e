"""Eviction order of the sparse prefix store (pure)."""

from __future__ import annotations

from kvstate.prefix.eviction import Policy, Unit, eviction_order


def _u(entry, pos, nbytes, clock, saved):
    return Unit(entry, pos, nbytes, clock, saved)


def test_lru_evicts_oldest_first_and_checkpoints_before_entries_on_ties():
    units = [_u(1, None, 100, 5, 9.0), _u(2, 64, 10, 3, 1.0), _u(2, None, 100, 3, 5.0), _u(3, None, 50, 7, 0.0)]
    order = eviction_order(units, Policy.LRU, flops_per_token=1.0)
    assert [(u.entry, u.position) for u in order] == [(2, 64), (2, None), (1, None), (3, None)]


def test_utility_keeps_what_saves_most_per_byte_at_equal_recency():
    cheap_but_useless = _u(1, 64, 10, 5, 0.0)
    useful_dense = _u(2, 128, 10, 5, 50.0)
    bulky = _u(3, None, 10_000, 5, 50.0)  # saves as much, but per byte far less
    order = eviction_order([useful_dense, bulky, cheap_but_useless], Policy.UTILITY, flops_per_token=2.0)
    assert order[-1] is useful_dense
    assert order[0] is cheap_but_useless


def test_utility_recency_term_breaks_equal_efficiency():
    old, new = _u(1, 64, 10, 1, 5.0), _u(2, 64, 10, 9, 5.0)
    assert eviction_order([new, old], Policy.UTILITY, flops_per_token=1.0)[0] is old
    assert eviction_order([], Policy.UTILITY, flops_per_token=1.0) == []
