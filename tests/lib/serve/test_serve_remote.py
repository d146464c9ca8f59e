"""Two servers sharing one real redis-server (``ServeConfig(remote=...)``, ``kvstate serve --remote``): a document
first sent to server A resumes on server B, which ``/metrics`` shows as a remote hit; Redis going away is a
``remote_up 0`` gauge and an error count while both keep serving."""

from __future__ import annotations

import pytest
from openai import OpenAI
from typer.testing import CliRunner

from kvstate.cli import app
from kvstate.errors import KVStateError
from kvstate.serve.config import ServeConfig
from tests.lib.prefix.redis_server import RedisServer, redis_server  # noqa: F401 (fixture)
from tests.lib.serve.conftest import serve

DOC = "system text : " + " ".join(f"w{(7 * i) % 100 + 10}" for i in range(120))


def _ask(url: str, question: str) -> tuple[str, int]:
    client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    r = client.chat.completions.create(model="tiny", max_tokens=4, temperature=0, messages=[
        {"role": "system", "content": DOC}, {"role": "user", "content": question}])
    cached = r.usage.prompt_tokens_details.cached_tokens if r.usage.prompt_tokens_details else 0
    return r.choices[0].message.content or "", int(cached or 0)


def test_a_document_sent_to_server_a_resumes_on_server_b(tiny, redis_server: RedisServer):  # noqa: F811
    a_gen = serve(tiny, remote=redis_server.url)
    b_gen = serve(tiny, remote=redis_server.url)
    off_gen = serve(tiny, budget_bytes=None)
    a, b, off = next(a_gen), next(b_gen), next(off_gen)
    try:
        assert a.metrics()["kvstate_prefix_remote_enabled"] == 1.0
        _ask(a.url, "w1 w2 w3 ?")
        ma = a.metrics()
        assert ma["kvstate_prefix_remote_puts_total"] > 0 and ma["kvstate_prefix_remote_up"] == 1.0
        reply, cached = _ask(b.url, "w4 w5 ?")  # B never saw the document: it resumes from the shared tier
        mb = b.metrics()
        assert mb["kvstate_prefix_remote_hits_total"] == 1.0 and mb["kvstate_prefix_remote_reused_tokens_total"] > 100
        assert cached >= 100 and mb["kvstate_prefix_remote_bad_entries_total"] == 0.0
        assert reply == _ask(off.url, "w4 w5 ?")[0]  # the same reply as a server without any cache
        redis_server.stop()  # the tier goes away: both keep serving, local-only, and say so
        reply2, _ = _ask(b.url, "w6 w7 w8 ?")
        mb = b.metrics()
        assert mb["kvstate_prefix_remote_up"] == 0.0 and mb["kvstate_prefix_remote_errors_total"] >= 1.0
        assert reply2 == _ask(off.url, "w6 w7 w8 ?")[0]
    finally:
        for g in (a_gen, b_gen, off_gen):
            g.close()


def test_a_cache_off_server_reports_no_remote_tier(tiny):
    gen = serve(tiny)
    running = next(gen)
    try:
        m = running.metrics()
        assert m["kvstate_prefix_remote_enabled"] == 0.0 and "kvstate_prefix_remote_up" not in m
    finally:
        gen.close()


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(budget_bytes=None, remote="redis://127.0.0.1:6379/0"), "remote: a shared tier needs the prefix cache"),
    (dict(remote="http://127.0.0.1:6379"), "redis://"),
])
def test_bad_remote_settings_are_one_clear_error(kwargs, message):
    with pytest.raises(KVStateError, match=message):
        ServeConfig(model_id="tiny", **kwargs)


def test_the_command_line_refuses_a_bad_remote_url_before_loading(tmp_path):
    res = CliRunner().invoke(app, ["serve", "--model", str(tmp_path), "--remote", "http://x:1", "--port", "1"])
    assert res.exit_code != 0 and "redis://" in (res.output + str(res.exception))


def test_keyed_replicas_share_and_an_unkeyed_writer_is_refused(tiny, redis_server: RedisServer, tmp_path):  # noqa: F811
    key = tmp_path / "cluster.key"
    key.write_text("a-cluster-secret-of-32-bytes-xyz\n")
    a_gen = serve(tiny, remote=redis_server.url, remote_key_file=str(key))
    b_gen = serve(tiny, remote=redis_server.url, remote_key_file=str(key))
    rogue_gen = serve(tiny, remote=redis_server.url)  # same model and Redis, no key
    c_gen = serve(tiny, remote=redis_server.url, remote_key_file=str(key))
    a, b, rogue, c = next(a_gen), next(b_gen), next(rogue_gen), next(c_gen)
    try:
        _ask(a.url, "w1 w2 w3 ?")
        _, cached = _ask(b.url, "w4 w5 ?")
        assert cached >= 100 and b.metrics()["kvstate_prefix_remote_hits_total"] == 1.0  # key holders share
        redis_server.client().flushdb()
        _ask(rogue.url, "w1 w2 w3 ?")  # the unkeyed replica writes the document's entries
        _, cached = _ask(c.url, "w6 w7 ?")  # a keyed replica without the document refuses what it finds
        mc = c.metrics()
        assert cached == 0 and mc["kvstate_prefix_remote_bad_entries_total"] >= 1.0
    finally:
        for g in (a_gen, b_gen, rogue_gen, c_gen):
            g.close()
