"""Grid checkpoints (kvstate.prefix.grid) against brute force and full recomputation, on tiny hybrid models."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from kvstate.errors import KVStateError
from kvstate.models import segmented_prefill
from kvstate.prefix.engine import SparsePrefixCache
from kvstate.prefix.grid import GridConfig, affordable, grid_positions, grid_step, to_thin
from tests.conftest import RECURRENT_FAMILIES, get_model, random_ids

MiB = 1 << 20


def _probe(doc: torch.Tensor, p: int, tail: int = 4, seed: int = 0) -> torch.Tensor:
    """``doc``'s first ``p`` tokens, then a token that differs from ``doc[p]``, then ``tail`` more."""
    nxt = (doc[:, p : p + 1] + 1) % 128 if p < doc.shape[1] else random_ids(1, seed=seed + 500)
    return torch.cat([doc[:, :p], nxt, random_ids(tail, seed=seed + 1000)], 1)


def _tensor_bytes(obj: Any) -> int:
    """Bytes of every tensor reachable from ``obj`` (dataclasses, sequences, dicts)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return sum(_tensor_bytes(getattr(obj, f.name)) for f in dataclasses.fields(obj))
    if isinstance(obj, list | tuple):
        return sum(_tensor_bytes(x) for x in obj)
    if isinstance(obj, dict):
        return sum(_tensor_bytes(x) for x in obj.values())
    return 0


def _grid_states_bytes(cache: SparsePrefixCache) -> int:
    """Bytes of the grid states the store holds, from their tensors (found by walking the store)."""
    total = 0
    for e in cache.grid_ledger.entries():
        path, _ = cache.store._walk(e.tokens[: e.position])
        st = cache.store._find_state(path, e.position)
        assert st is not None, f"the ledger lists a grid state at {e.position} the store does not hold"
        total += _tensor_bytes(st.payload)
    return total


# -- pure parts ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("field,value", [("block", -1), ("block", 1.5), ("budget_share", 1.5),
                                         ("budget_share", float("nan")), ("thin_after", -2), ("thin_after", True)])
def test_config_refuses_bad_values_naming_the_field(field, value):
    with pytest.raises(KVStateError, match=field):
        GridConfig(**{field: value})


def test_positions_step_and_affordable_against_brute_force():
    for block in range(1, 40):
        for align in (1, 4, 8, 16):
            s = grid_step(block, align)
            assert s % align == 0 and s >= align and (s <= block or block < align)
    for step in (1, 3, 8):
        for start in range(0, 30):
            for end in range(0, 40):
                want = [p for p in range(1, end) if p % step == 0 and start < p]
                assert grid_positions(start, end, step) == want
    for held in range(0, 50, 7):
        for budget in range(0, 60, 9):
            got = affordable([40, 8, 24], 10, held, budget)
            n = max((budget - held) // 10, 0)
            assert got == [8, 24, 40][:n]


def test_to_thin_drops_only_observed_unplanned_unrestored():
    grid = [16, 32, 48, 64]
    obs = [(16, 3.0), (32, 1.0), (48, 2.0), (64, 5.0)]
    assert to_thin(grid, plan=[64], restored=48, observed=obs, thin_after=2) == [16]
    assert to_thin(grid, plan=[], restored=0, observed=obs, thin_after=2) == [16, 48, 64]
    assert to_thin(grid, plan=[], restored=0, observed=obs, thin_after=0) == []


# -- the engine ------------------------------------------------------------------------------------------
def _held_positions(cache: SparsePrefixCache, doc: torch.Tensor) -> list[int]:
    tokens = tuple(int(t) for t in doc[0].tolist())
    return cache.grid_ledger.held_at(tokens, range(1, len(tokens) + 1))


@pytest.mark.parametrize("family", RECURRENT_FAMILIES)
@pytest.mark.parametrize("full_state", [False, True])
def test_resume_from_a_grid_state_equals_full_recompute(family, full_state):
    model = get_model(family)
    # no planned checkpoints at all (slots 0): whatever is restored mid-prefix is a grid state
    cache = SparsePrefixCache(model, budget_bytes=64 * MiB, slots_per_entry=0, align=8,
                              grid=GridConfig(block=16, budget_share=0.5))
    doc = random_ids(90, seed=1)
    cache.prefill(doc, full_state=full_state)
    assert _held_positions(cache, doc) == [16, 32, 48, 64, 80]
    ids = _probe(doc, 53, seed=2)
    res = cache.prefill(ids, full_state=full_state)
    assert res.reused_tokens == 48 and res.recomputed_tokens == ids.shape[1] - 48
    full = segmented_prefill(model, ids).logits
    assert float((res.logits - full).abs().max()) < 1e-4


def test_every_divergence_point_restores_the_grid_floor_brute_force():
    model = get_model("qwen3_5")
    n_doc, block = 100, 16
    cache = SparsePrefixCache(model, budget_bytes=64 * MiB, slots_per_entry=0, align=8,
                              grid=GridConfig(block=block, budget_share=0.5))
    doc = random_ids(n_doc, seed=3)
    cache.prefill(doc)  # full_state=False: the end state covers n_doc - 1 tokens
    for p in range(0, n_doc + 1):
        hit = cache.lookup(_probe(doc, p, seed=p))
        floor = p // block * block
        want = max(floor if floor < n_doc - 1 else 0, n_doc - 1 if p >= n_doc - 1 else 0)
        assert hit.overlap == p and hit.position == want, (p, hit)


def test_a_prefix_seen_once_is_hit_at_the_grid_floor_or_better_than_the_exact_placement():
    """The measured failure: once requests share a first token, a new prefix's plan captures nothing mid-prompt
    (all observed overlap is at depth 1), so its second sighting restores nothing. With the grid it restores
    the grid floor, or the exact placement's deeper state where that one is deeper."""
    model = get_model("qwen3_5")
    block, n_doc = 64, 300
    restored: dict[str, list[int]] = {}
    for arm, grid in (("off", None), ("on", GridConfig(block=block, budget_share=0.5))):
        cache = SparsePrefixCache(model, budget_bytes=64 * MiB, grid=grid)  # default slots, planner, align 64
        other = torch.cat([torch.tensor([[1]]), random_ids(n_doc - 1, seed=4)], 1)
        doc = torch.cat([torch.tensor([[1]]), random_ids(n_doc - 1, seed=5)], 1)  # shares token 1 with `other`
        cache.prefill(other)
        cache.prefill(doc)
        restored[arm] = [cache.lookup(_probe(doc, p, seed=p)).position for p in range(0, n_doc + 1)]
    for p, (off, on) in enumerate(zip(restored["off"], restored["on"], strict=True)):
        floor = p // block * block
        assert on == max(off, floor if floor < n_doc - 1 else 0), (p, off, on)
    assert restored["off"][256] < 256 <= restored["on"][256]  # the grid is what made the difference here


def test_grid_states_stay_within_their_byte_share_measured_from_tensors():
    model = get_model("qwen3_5")
    budget = 64 * MiB
    probe = SparsePrefixCache(model, budget_bytes=budget, slots_per_entry=0, align=8, grid=GridConfig(block=8))
    probe.prefill(random_ids(20, seed=6))
    each = _grid_states_bytes(probe) // len(probe.grid_ledger)
    share = 5.5 * each / budget  # room for 5 grid states, not 6
    cache = SparsePrefixCache(model, budget_bytes=budget, slots_per_entry=0, align=8,
                              grid=GridConfig(block=8, budget_share=share))
    docs = [random_ids(40, seed=10 + i) for i in range(4)]
    for doc in docs:
        cache.prefill(doc)
        held = _grid_states_bytes(cache)
        assert held == cache.grid_ledger.nbytes and 0 < held <= share * budget
    # the least recently used go first (a document's shallower states before its deeper ones): the newest
    # document keeps all 4 of its grid states, the one before it its deepest, the older ones none
    assert [_held_positions(cache, d) for d in docs] == [[], [], [32], [8, 16, 24, 32]]


def test_observed_overlaps_thin_the_grid_to_what_the_plan_keeps():
    model = get_model("qwen3_5")
    held: dict[int, list[int]] = {}
    for thin_after in (0, 2):
        cache = SparsePrefixCache(model, budget_bytes=64 * MiB, align=8,
                                  grid=GridConfig(block=16, budget_share=0.5, thin_after=thin_after))
        # a request sharing the first token first: the document's own plan then captures nothing mid-prompt
        cache.prefill(torch.cat([torch.tensor([[1]]), random_ids(99, seed=11)], 1))
        doc = torch.cat([torch.tensor([[1]]), random_ids(99, seed=8)], 1)
        cache.prefill(doc)
        first = _held_positions(cache, doc)
        assert first == [16, 32, 48, 64, 80, 96]
        for i in range(4):  # requests that all part from the document at depth 64
            res = cache.prefill(_probe(doc, 64, seed=20 + i))
            assert res.reused_tokens == 64
        held[thin_after] = _held_positions(cache, doc)
    assert held[0] == [16, 32, 48, 64, 80, 96]
    # thinned: grid states at depths the overlaps reached and the plan does not keep are gone; the one every
    # request restored stays, and so do those deeper than any overlap (nothing observed there)
    assert set(held[2]) < set(held[0]) and {64, 80, 96} <= set(held[2])


def test_grid_off_by_default_and_on_attention_only_models_nothing_changes():
    doc = random_ids(80, seed=9)
    cache = SparsePrefixCache(get_model("qwen3_5"), budget_bytes=64 * MiB, align=8)
    cache.prefill(doc)
    assert cache.grid is None and len(cache.grid_ledger) == 0
    attn = SparsePrefixCache(get_model("qwen3"), budget_bytes=64 * MiB, align=8, grid=GridConfig(block=8))
    attn.prefill(doc)
    assert len(attn.grid_ledger) == 0 and attn.bytes_by_kind()["checkpoints"] == 0
