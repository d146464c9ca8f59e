"""The shared tier cannot serve the wrong state: entries bound to their tokens and model, checked tensors,
an optional cluster key (HMAC), and caches that carry the model that filled them — against a real
redis-server, every answer compared with full recompute."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvstate.errors import KVStateError
from kvstate.models import segmented_prefill
from kvstate.models.state import restore_cache
from kvstate.models.tiny import tiny_model
from kvstate.prefix import PrefixCacheConfig
from kvstate.prefix.engine import SparsePrefixCache
from kvstate.prefix.shared_tier import KEY_ENV, SharedTier, decode, encode, load_key
from tests.conftest import get_model, random_ids
from tests.lib.prefix.redis_server import RedisServer, redis_server  # noqa: F401 (fixture)

MiB = 1 << 20
EXACT = 1e-4  # an exact hit agrees with recompute to ~1e-6; a wrong state is off by 1e-1 and more


@pytest.fixture
def server(redis_server):  # type: ignore[no-untyped-def]  # noqa: F811 (the shared fixture, by name)
    return redis_server


def _engine(model, url: str, key_file: Path | None = None) -> SparsePrefixCache:  # type: ignore[no-untyped-def]
    cfg = PrefixCacheConfig(32 * MiB, slots_per_entry=2, align=8, remote=url, remote_retry_s=0.0,
                            remote_key_file=None if key_file is None else str(key_file))
    return SparsePrefixCache(model, cfg)


def _full(model, ids):  # type: ignore[no-untyped-def]
    return segmented_prefill(model, ids).logits


def _shared(engine: SparsePrefixCache) -> SharedTier:
    tier = engine._shared
    assert tier is not None
    return tier


def _entry_keys(engine: SparsePrefixCache, tokens: list[int], p: int) -> list[str]:
    """The KV chunk keys before ``p`` and the state key at ``p`` a request for ``tokens`` reads."""
    t = _shared(engine)
    chain = t.chain(tokens)
    return [t.kv_key(chain, k) for k in range(1, p // t.align + 1)] + [t.state_key(chain, tokens, p)]


def test_another_documents_entries_under_this_documents_keys_are_refused(server: RedisServer) -> None:
    model = get_model("qwen3_5")
    a, b = _engine(model, server.url), _engine(model, server.url)
    x, y = random_ids(24, seed=40), random_ids(24, seed=41)
    for doc in (x, y):
        a.prefill(torch.cat([doc, random_ids(5, seed=42)], 1), boundaries=[24])
    r = server.client()
    xs, ys = x[0].tolist(), y[0].tolist()
    for kx, ky in zip(_entry_keys(a, xs, 24), _entry_keys(a, ys, 24), strict=True):
        data = r.get(kx)
        assert data is not None
        r.set(ky, data)  # X's valid entries, filed under Y's keys
    q = torch.cat([y, random_ids(6, seed=43)], 1)
    res = b.prefill(q, boundaries=[24])
    torch.testing.assert_close(res.logits, _full(model, q), atol=EXACT, rtol=0)
    m = b.remote_metrics
    assert m is not None and res.reused_tokens == 0 and m.hits == 0 and m.corrupt >= 1


def _reencode(data: bytes, change, names: str) -> bytes:  # type: ignore[no-untyped-def]
    tensors, head = decode(data)
    # a valid SHA-256 over the changed tensors: no key to stop it
    return encode({n: change(t) if n[0] in names else t for n, t in tensors.items()}, head)


@pytest.mark.parametrize("change, names", [
    (lambda t: t.double(), "cr"),  # recurrent states as float64: passed the checks, then every replica 500
    (lambda t: t.half(), "cr"),
    (lambda t: t.double(), "kvcr"),
    (lambda t: torch.full_like(t, float("nan")), "kvcr"),
    (lambda t: torch.where(torch.rand_like(t) < 0.5, torch.full_like(t, float("inf")), t), "cr"),
], ids=["state-float64", "state-float16", "all-float64", "nan", "state-inf"])
def test_reencoded_entries_are_refused_and_the_reply_is_exact(server: RedisServer, change, names) -> None:  # type: ignore[no-untyped-def]
    model = get_model("qwen3_5")
    a, b = _engine(model, server.url), _engine(model, server.url)
    doc = random_ids(24, seed=44)
    a.prefill(torch.cat([doc, random_ids(5, seed=45)], 1), boundaries=[24])
    r = server.client()
    for k in r.keys("*"):
        r.set(k, _reencode(r.get(k), change, names))
    q = torch.cat([doc, random_ids(7, seed=46)], 1)
    res = b.prefill(q, boundaries=[24])  # never an error: refused, computed locally
    torch.testing.assert_close(res.logits, _full(model, q), atol=EXACT, rtol=0)
    m = b.remote_metrics
    assert m is not None and res.reused_tokens == 0 and m.corrupt >= 1 and m.hits == 0
    # the refused entry was deleted, then B wrote the good one through: a third replica resumes exactly
    c = _engine(model, server.url)
    res_c = c.prefill(torch.cat([doc, random_ids(4, seed=47)], 1), boundaries=[24])
    mc = c.remote_metrics
    assert mc is not None and res_c.reused_tokens == 24 and mc.corrupt == 0


def test_a_restore_that_fails_after_the_checks_is_a_local_computation(server: RedisServer, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    model = get_model("qwen3_5")
    a, b = _engine(model, server.url), _engine(model, server.url)
    doc = random_ids(24, seed=48)
    a.prefill(torch.cat([doc, random_ids(5, seed=49)], 1), boundaries=[24])
    good = SharedTier.lookup

    def lying(self, tokens, local, candidates):  # type: ignore[no-untyped-def]
        got = good(self, tokens, local, candidates)
        return None if got is None else (got[0], [], got[2])  # no KV where the cache needs some

    monkeypatch.setattr(SharedTier, "lookup", lying)
    q = torch.cat([doc, random_ids(6, seed=50)], 1)
    res = b.prefill(q, boundaries=[24])
    torch.testing.assert_close(res.logits, _full(model, q), atol=EXACT, rtol=0)
    m = b.remote_metrics
    assert m is not None and res.reused_tokens == 0 and m.corrupt == 1


def _key_file(tmp_path: Path, secret: bytes) -> Path:
    f = tmp_path / f"key-{len(list(tmp_path.iterdir()))}"
    f.write_bytes(secret)
    return f


def test_a_keyed_tier_is_shared_by_key_holders_and_refuses_everything_else(server: RedisServer,
                                                                           tmp_path: Path) -> None:
    model = get_model("qwen3_5")
    key = _key_file(tmp_path, b"0123456789abcdef-cluster-secret\n")
    a, b = _engine(model, server.url, key), _engine(model, server.url, key)
    doc = random_ids(24, seed=51)
    a.prefill(torch.cat([doc, random_ids(5, seed=52)], 1), boundaries=[24])
    q = torch.cat([doc, random_ids(6, seed=53)], 1)
    res = b.prefill(q, boundaries=[24])
    torch.testing.assert_close(res.logits, _full(model, q), atol=EXACT, rtol=0)
    assert res.reused_tokens == 24  # the key holders share

    # an unkeyed writer (or one with another key), and values scaled and re-checksummed by hand: refused
    doc2, doc3 = random_ids(24, seed=54), random_ids(24, seed=55)
    _engine(model, server.url).prefill(torch.cat([doc2, random_ids(5, seed=56)], 1), boundaries=[24])
    other = _key_file(tmp_path, b"another-cluster-secret-000")
    _engine(model, server.url, other).prefill(torch.cat([doc3, random_ids(5, seed=57)], 1), boundaries=[24])
    for d, s in ((doc2, 58), (doc3, 59)):
        q2 = torch.cat([d, random_ids(6, seed=s)], 1)
        r2 = b.prefill(q2, boundaries=[24])
        torch.testing.assert_close(r2.logits, _full(model, q2), atol=EXACT, rtol=0)
        assert r2.reused_tokens == 0
    r = server.client()
    for k in r.keys("*"):
        tensors, head = decode(r.get(k))
        r.set(k, encode({n: t * 1.5 for n, t in tensors.items()}, head))  # the old MAC kept: it no longer fits
    c = _engine(model, server.url, key)
    q3 = torch.cat([doc, random_ids(4, seed=60)], 1)
    r3 = c.prefill(q3, boundaries=[24])
    torch.testing.assert_close(r3.logits, _full(model, q3), atol=EXACT, rtol=0)
    m = c.remote_metrics
    assert m is not None and r3.reused_tokens == 0 and m.corrupt >= 1 and m.hits == 0


def test_the_key_comes_from_a_file_or_the_environment_and_is_checked(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv(KEY_ENV, raising=False)
    assert load_key(None) is None
    assert load_key(str(_key_file(tmp_path, b"  0123456789abcdef  \n"))) == b"0123456789abcdef"
    monkeypatch.setenv(KEY_ENV, "fedcba9876543210")
    assert load_key(None) == b"fedcba9876543210"
    with pytest.raises(KVStateError, match="at least 16"):
        load_key(str(_key_file(tmp_path, b"short")))
    with pytest.raises(KVStateError, match="cannot be read"):
        load_key(str(tmp_path / "missing"))


def test_an_unkeyed_tier_warns_at_startup(server: RedisServer, monkeypatch, caplog) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv(KEY_ENV, raising=False)
    with caplog.at_level("WARNING", logger="kvstate.prefix.shared_tier"):
        _engine(get_model("qwen3_5"), server.url)
    assert any("trusted as is" in r.getMessage() for r in caplog.records)


def test_insert_refuses_a_same_shape_cache_another_model_filled() -> None:
    ours, theirs = get_model("qwen3_5"), tiny_model("qwen3_5", seed=1)
    assert [p.shape for p in ours.parameters()] == [p.shape for p in theirs.parameters()]
    cache = SparsePrefixCache(ours, 16 * MiB, slots_per_entry=2, align=8)
    ids = random_ids(12, seed=61)
    foreign = SparsePrefixCache(theirs, 16 * MiB, slots_per_entry=2, align=8).prefill(ids).cache
    with pytest.raises(KVStateError, match="filled by model"):
        cache.insert(ids, foreign)
    out = segmented_prefill(ours, ids, cuts=[11])
    untagged = restore_cache(ours.config, out.snapshots[11])
    with pytest.raises(KVStateError, match="carries no origin"):
        cache.insert(ids, untagged)
    assert cache.metrics.requests == 0 and cache.store.nodes() == []
    assert cache.insert(ids, untagged, trusted=True)  # the caller vouches for it
    assert cache.insert(ids, cache.prefill(ids).cache)  # its own prefill's cache carries its tag


def test_boundaries_that_are_not_a_list_are_one_clear_error() -> None:
    cache = SparsePrefixCache(get_model("qwen3_5"), 16 * MiB, slots_per_entry=2, align=8)
    ids = random_ids(12, seed=62)
    for bad in (6, "6", 6.0):
        with pytest.raises(KVStateError, match="not a list of token positions"):
            cache.prefill(ids, boundaries=bad)  # type: ignore[arg-type]
    assert cache.metrics.requests == 0
