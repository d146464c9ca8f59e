"""``replay_server`` / ``kvstate prefix replay --server``: a trace replayed through servers on loopback (a tiny
hybrid, the cache on and off), with the real ``openai`` client."""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from kvstate.cli import app
from kvstate.errors import KVStateError
from kvstate.lab.prefix.replay_server import replay_server
from kvstate.lab.workloads.traces import Request, generate, write_trace
from tests.lib.serve.conftest import serve, tiny  # noqa: F401 (fixture)


@pytest.fixture(scope="module")
def servers(tiny):  # noqa: F811
    on, off = serve(tiny), serve(tiny, budget_bytes=None)
    yield next(on), next(off)
    on.close()
    off.close()


def _chat(n: int = 6) -> list[Request]:
    reqs = generate("chat", n, seed=3, vocab=128, scale=0.1)
    assert len({r.prefix_id for r in reqs}) < n  # some turns extend an earlier one
    return reqs


def test_a_chat_trace_through_the_cached_server_reuses_the_previous_turns(servers):
    on, off = servers
    reqs = _chat()
    r = replay_server(on.url, reqs, baseline_url=off.url)
    assert r.requests == len(reqs) and r.tokens_total == sum(q.length for q in reqs)
    # every turn after a conversation's first resumes at least from the end of the previous turn
    assert r.tokens_reused >= sum(q.overlap for q in reqs) > 0
    assert all(row["ttft_s"] > 0 and row["ttft_s_baseline"] > 0 for row in r.per_request)
    assert math.isfinite(r.ttft_ratio) and r.ttft_s_median > 0 and r.ttft_s_median_baseline > 0
    alone = replay_server(off.url, reqs[:2])  # no baseline, a server without a prefix cache
    assert math.isnan(alone.ttft_s_median_baseline) and math.isnan(alone.tokens_reused)


def test_the_command_replays_a_trace_file_through_the_servers(servers, tmp_path):
    on, off = servers
    trace = tmp_path / "chat.jsonl"
    write_trace(trace, _chat(4))
    res = CliRunner().invoke(app, ["prefix", "replay", "--trace", str(trace), "--server", on.url,
                                   "--baseline-server", off.url, "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout[res.stdout.index("{"):])
    assert out["result"]["requests"] == 4 and out["result"]["tokens_reused"] > 0


def test_an_unreachable_server_or_a_trace_without_ids_is_one_clear_error(servers, tmp_path):
    on, _ = servers
    with pytest.raises(KVStateError, match="cannot reach the server"):
        replay_server("http://127.0.0.1:9", _chat(2))
    with pytest.raises(KVStateError, match="token ids"):
        replay_server(on.url, [Request(None, "doc-0", 0, 10)])
    res = CliRunner().invoke(app, ["prefix", "replay", "--trace", str(tmp_path / "t.jsonl")])
    assert res.exit_code != 0 and "--server" in (res.output + str(res.exception))
