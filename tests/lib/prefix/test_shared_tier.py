"""The prefix cache's shared tier: two engines sharing one real redis-server, against full recompute."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvstate.errors import KVStateError
from kvstate.models import model_fingerprint, segmented_prefill
from kvstate.prefix import PrefixCacheConfig
from kvstate.prefix.engine import SparsePrefixCache
from kvstate.prefix.shared_tier import decode, encode
from tests.conftest import get_model, random_ids
from tests.lib.prefix.redis_server import RedisServer, redis_server  # noqa: F401 (fixture)

MiB = 1 << 20


@pytest.fixture
def server(redis_server):  # type: ignore[no-untyped-def]  # noqa: F811 (the shared fixture, by name)
    return redis_server


def _engine(model, url: str, **kw) -> SparsePrefixCache:  # type: ignore[no-untyped-def]
    cfg = PrefixCacheConfig(32 * MiB, slots_per_entry=2, align=8, remote=url, remote_retry_s=0.0, **kw)
    return SparsePrefixCache(model, cfg)


def _full(model, ids):  # type: ignore[no-untyped-def]
    return segmented_prefill(model, ids).logits


def test_a_document_first_served_by_a_resumes_on_b(server: RedisServer) -> None:
    model = get_model("qwen3_5")
    a, b = _engine(model, server.url), _engine(model, server.url)
    doc = random_ids(37, seed=1)
    q1, q2 = torch.cat([doc, random_ids(6, seed=2)], 1), torch.cat([doc, random_ids(5, seed=3)], 1)
    ra = a.prefill(q1, boundaries=[37])
    assert ra.reused_tokens == 0
    rb = b.prefill(q2, boundaries=[37])
    assert rb.reused_tokens == 37  # the declared document end, computed on A
    torch.testing.assert_close(rb.logits, _full(model, q2), atol=1e-4, rtol=0)
    m = b.remote_metrics
    assert m is not None and m.hits == 1 and m.tokens_reused == 37 and m.up and m.errors == 0
    # B inserted it locally: the next question on B resumes with no remote read
    rb2 = b.prefill(torch.cat([doc, random_ids(4, seed=4)], 1), boundaries=[37])
    m2 = b.remote_metrics
    assert rb2.reused_tokens == 37 and m2 is not None and m2.hits == 1
    keys = server.client().keys("*")
    fp16 = model_fingerprint(model)[:16]
    assert keys and all(k.decode().startswith(f"kvstate:{{{fp16}}}:") for k in keys)  # one hash tag per model


def test_bad_remote_entries_are_counted_misses(server: RedisServer) -> None:
    model = get_model("qwen3_5")
    a, b = _engine(model, server.url), _engine(model, server.url)
    doc = random_ids(24, seed=5)
    q = torch.cat([doc, random_ids(5, seed=6)], 1)
    a.prefill(q, boundaries=[24])
    r = server.client()
    st_keys = [k for k in r.keys("*:st:*")]
    assert st_keys
    # a bad checksum, another model's fingerprint, wrong shapes: each refused, the answer still exact
    for k in st_keys:
        data = r.get(k)
        tensors, head = decode(data)
        bad = bytearray(data)
        bad[-1] ^= 0xFF
        variants = [
            bytes(bad),
            encode(tensors, {**head, "model": "0" * 64}),
            encode({n: t[..., :1] for n, t in tensors.items()}, head),
            b"not safetensors",
        ]
        r.set(k, variants[st_keys.index(k) % len(variants)])
    q2 = torch.cat([doc, random_ids(7, seed=7)], 1)
    res = b.prefill(q2, boundaries=[24])
    torch.testing.assert_close(res.logits, _full(model, q2), atol=1e-4, rtol=0)
    m = b.remote_metrics
    assert m is not None and res.reused_tokens == 0 and m.corrupt >= 1 and m.hits == 0 and m.misses == 1


def test_redis_going_away_degrades_to_local_only_and_recovers(server: RedisServer) -> None:
    model = get_model("qwen3_5")
    a = _engine(model, server.url)
    server.stop()
    ids = random_ids(20, seed=8)
    res = a.prefill(ids)
    torch.testing.assert_close(res.logits, _full(model, ids), atol=1e-4, rtol=0)
    m = a.remote_metrics
    assert m is not None and not m.up and m.errors >= 1
    server.start()
    ids2 = random_ids(21, seed=9)
    a.prefill(ids2)
    m2 = a.remote_metrics
    assert m2 is not None and m2.up and m2.puts > m.puts


def test_remote_url_is_validated() -> None:
    for url, msg in [("http://x:1/0", "scheme"), ("redis://", "no host"), ("redis://h:1/abc", "database"), ("", "not a URL"),
                     ("redis://127.0.0.1:6379/0?socket_timeout=abc", "socket_timeout")]:
        with pytest.raises(KVStateError, match=msg):
            PrefixCacheConfig(MiB, remote=url)


DOCS = [random_ids(26, seed=20), random_ids(19, seed=21)]
QUESTIONS = [random_ids(k, seed=30 + k) for k in (3, 5, 9)]


class TwoReplicas(RuleBasedStateMachine):
    """Prefill on A or B, kill / restart / flush Redis, corrupt a key: every answer equals recompute."""

    def __init__(self) -> None:
        super().__init__()
        self.model = get_model("qwen3_5")
        self.server = RedisServer()
        self.server.start()
        self.engines = [_engine(self.model, self.server.url), _engine(self.model, self.server.url)]
        self.up = True

    @rule(which=st.integers(0, 1), doc=st.integers(0, 1), q=st.integers(0, 2))
    def prefill(self, which: int, doc: int, q: int) -> None:
        ids = torch.cat([DOCS[doc], QUESTIONS[q]], 1)
        res = self.engines[which].prefill(ids, boundaries=[DOCS[doc].shape[1]])
        torch.testing.assert_close(res.logits, _full(self.model, ids), atol=1e-4, rtol=0)
        m = self.engines[which].remote_metrics
        # a request that computed anything called the tier (a full local hit need not): the gauge is current
        assert m is not None and (res.recomputed_tokens == 0 or m.up == self.up)

    @rule()
    def kill(self) -> None:
        self.server.stop()
        self.up = False

    @rule()
    def restart(self) -> None:
        if self.server.proc is None:
            self.server.start()  # an empty Redis: everything written before is gone
            self.up = True

    @rule()
    def flush(self) -> None:
        if self.up:
            self.server.client().flushdb()

    @rule(pick=st.integers(0, 1000), how=st.integers(0, 1))
    def corrupt(self, pick: int, how: int) -> None:
        if not self.up:
            return
        r = self.server.client()
        keys = sorted(r.keys("*"))
        if keys:
            k = keys[pick % len(keys)]
            data = r.get(k) or b""
            r.set(k, data[: len(data) // 2] if how else data[:-1] + bytes([data[-1] ^ 1]))

    @invariant()
    def counters_are_sane(self) -> None:
        for e in self.engines:
            m = e.remote_metrics
            assert m is not None and min(m.hits, m.misses, m.corrupt, m.errors, m.puts) >= 0

    def teardown(self) -> None:
        self.server.stop()


TwoReplicas.TestCase.settings = settings(
    max_examples=6, stateful_step_count=8, deadline=None, suppress_health_check=list(HealthCheck)
)
test_two_replicas_state_machine = TwoReplicas.TestCase
