"""Cache events: replaying every store / evict event gives exactly what the store holds (KV blocks and
recurrent checkpoints by content hash), through random requests, inserts and evictions."""

from __future__ import annotations

import pytest
import torch

from kvstate.models import checkpoint_bytes, kv_bytes_per_token
from kvstate.prefix import hashing
from kvstate.prefix.engine import SparsePrefixCache
from kvstate.prefix.events import CacheEvents
from tests.conftest import get_model, random_ids


def _path(v) -> tuple[int, ...]:  # type: ignore[no-untyped-def]
    edges = []
    while v is not None and v.parent is not None:
        edges.append(v.edge)
        v = v.parent
    return tuple(t for e in reversed(edges) for t in e)


def _held(cache: SparsePrefixCache) -> tuple[set[str], set[str]]:
    """The KV blocks and checkpoints the store holds, hashed as the events hash them (the oracle)."""
    a, fp = cache.align, cache.fingerprint
    blocks, checkpoints = set(), set()
    for v in cache.store.nodes():
        tokens = _path(v)
        h = hashing.chain(fp, tokens, a)
        if cache.store.config.has_attention:
            blocks |= {h[k].hex()[:32] for k in range(v.top // a + 1, v.depth // a + 1)}
        checkpoints |= {hashing.state_hash(h, tokens, p, a)[:32] for p in v.states}
    return blocks, checkpoints


def _replayed(events: CacheEvents) -> tuple[set[str], set[str]]:
    blocks: set[str] = set()
    checkpoints: set[str] = set()
    for e in events.since(0, 10**6)[0]:
        target, keys = (blocks, e.block_hashes) if e.kind == "kv" else (checkpoints, (e.prefix_hash,))
        if e.type == "stored":
            assert not set(keys) & target  # never stored twice without an eviction between
            target |= set(keys)
        else:
            assert set(keys) <= target  # only what was stored is evicted
            target -= set(keys)
    return blocks, checkpoints


@pytest.mark.parametrize("family", ["qwen3_5", "llama", "mamba2"])
def test_replaying_the_events_gives_what_the_store_holds(family: str) -> None:
    model = get_model(family)
    budget = 40 * kv_bytes_per_token(model.config) + 5 * checkpoint_bytes(model.config) + 4 * 128 * 4 + 4096
    cache = SparsePrefixCache(model, budget, slots_per_entry=2, align=4)
    docs = [random_ids(23, seed=d) for d in range(3)]
    g = torch.Generator().manual_seed(0)
    for step in range(24):
        d = int(torch.randint(0, 3, (1,), generator=g))
        cut = int(torch.randint(4, 23, (1,), generator=g))
        ids = torch.cat([docs[d][:, :cut], random_ids(int(torch.randint(1, 9, (1,), generator=g)), seed=100 + step)], 1)
        cache.prefill(ids, boundaries=[cut])
        assert _replayed(cache.events) == _held(cache)
    assert cache.metrics.evicted_nodes + cache.metrics.evicted_states > 0  # evictions were exercised
    events = cache.events.since(0, 10**6)[0]
    assert {e.type for e in events} == {"stored", "evicted"}


def test_a_reader_that_fell_behind_is_told_how_much_it_missed() -> None:
    log = CacheEvents("fp", 4, capacity=3)
    for i in range(5):
        log("stored", "state", tuple(range(i + 1)), 0)
    events, nxt, dropped = log.since(0)
    assert [e.seq for e in events] == [3, 4, 5] and nxt == 5 and dropped == 2
    assert log.since(5) == ([], 5, 0)
