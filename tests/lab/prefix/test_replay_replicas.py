"""The replay through two replicas sharing one real redis-server, on a tiny hybrid model."""

from __future__ import annotations

import random

import pytest

from kvstate.lab.prefix.replay import declared_boundaries, replay
from kvstate.lab.workloads.traces import Request
from kvstate.prefix import PrefixCacheConfig
from tests.conftest import get_model
from tests.lib.prefix.redis_server import RedisServer, redis_server  # noqa: F401 (fixture)


@pytest.fixture
def server(redis_server):  # type: ignore[no-untyped-def]  # noqa: F811 (the shared fixture, by name)
    return redis_server


def _trace() -> list[Request]:
    rng = random.Random(0)
    docs = [tuple(rng.randrange(128) for _ in range(40)) for _ in range(3)]
    out = []
    for q in range(2):  # every document once, then again: round-robin sends the second to the other replica
        for d, doc in enumerate(docs):
            toks = doc + tuple(rng.randrange(128) for _ in range(5 + q))
            out.append(Request(toks, f"doc{d}", 40 if q else 0, len(toks)))
    return out


def test_two_replicas_reuse_like_one_and_resume_across(server: RedisServer) -> None:
    model = get_model("qwen3_5")
    reqs = _trace()
    assert declared_boundaries([r.tokens for r in reqs]) == [[40]] * 6  # type: ignore[misc]
    cfg = PrefixCacheConfig(32 << 20, slots_per_entry=2, align=8)
    one = replay(model, reqs, cfg, declare=True, no_cache_baseline=False)
    two = replay(model, reqs, cfg, declare=True, replicas=2, remote=server.url, repeats=2)
    # the second question to each document resumes at its end, on the replica that never saw it
    assert [r["reused"] for r in two.per_request[3:]] == [40, 40, 40]
    assert two.replicas == 2 and two.remote_hits == 3 and two.remote_tokens_reused == 120
    assert two.tokens_reused >= 0.9 * one.tokens_reused and one.tokens_reused == 120
    assert two.repeats == 2 and two.wall_s > 0 and two.wall_s_no_cache > 0 and two.wall_ratio > 0
    with pytest.raises(Exception, match="shared tier"):
        replay(model, reqs, cfg, replicas=2)
