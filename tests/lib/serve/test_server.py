"""The OpenAI-compatible server end to end, through the real ``openai`` client on a loopback port.

Oracles: a completion equals a plain greedy decode of the same tokens; streamed deltas join to the
non-streamed text; a chat's second turn reuses tokens from the prefix cache and its reply equals the
cache-off server's. Also: a full queue answers 503 at once, a client that disconnects mid-stream stops
its generation and leaves nothing pinned, and every bad input is a 4xx in OpenAI's error shape after
which the server keeps serving.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx
import openai
import pytest
import torch
from openai import OpenAI

from kvstate.serve.chat import DEFAULT_CHAT_TEMPLATE
from kvstate.serve.policy import BatchPolicy
from tests.lib.serve.conftest import POSITIONS, Running, serve

# the default template behind a check real templates make: user messages may not follow each other
ALTERNATING = (
    "{% for m in messages %}{% if loop.index0 > 0 and m['role'] == 'user' and messages[loop.index0 - 1]['role']"
    " == 'user' %}{{ raise_exception('user messages must alternate with assistant ones') }}{% endif %}"
    "{% endfor %}" + DEFAULT_CHAT_TEMPLATE
)
SYSTEM = "system text : " + " ".join(f"w{i % 100}" for i in range(40))


@pytest.fixture(scope="module")
def on(tiny):  # type: ignore[no-untyped-def]
    yield from serve(tiny, chat_template=ALTERNATING)


@pytest.fixture(scope="module")
def off(tiny):  # type: ignore[no-untyped-def]
    yield from serve(tiny, budget_bytes=None, chat_template=ALTERNATING)


@pytest.fixture(scope="module")
def slow(tiny):  # type: ignore[no-untyped-def]
    """A batch of one and one waiting slot; each decode step takes 50 ms and no reply ends early (no
    end-of-sequence token)."""
    servers = serve(tiny, max_queue=1, policy=BatchPolicy(max_batch=1))
    running = next(servers)
    gen, batch = running.app.state.generator, running.app.state.scheduler._batch
    step = batch.step

    def slow_step(*args: Any, **kwargs: Any) -> Any:
        time.sleep(0.05)
        return step(*args, **kwargs)

    batch.step = slow_step
    gen.eos_ids = frozenset()
    yield running
    servers.close()  # stops the server


def client(r: Running) -> OpenAI:
    return OpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0, timeout=60)


def test_models_health_and_metrics(on: Running) -> None:
    assert [m.id for m in client(on).models.list()] == ["tiny"]
    assert httpx.get(on.url + "/health").json()["status"] == "ok"
    m = on.metrics()
    assert m["kvstate_prefix_cache_enabled"] == 1.0 and m["kvstate_queue_capacity"] == 256.0
    assert "kvstate_prefix_reused_tokens_total" in m and 'kvstate_prefix_bytes{kind="attention_kv"}' in m


def test_completion_equals_a_plain_greedy_decode(on: Running, tiny: tuple[Any, Any]) -> None:
    model, tok = tiny
    prompt = [1, 20, 31, 42, 53, 64, 75, 86, 97]
    r = client(on).completions.create(model="tiny", prompt=prompt, max_tokens=8)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None)
    new = out[0, len(prompt):].tolist()
    new = new[: new.index(2) + 1] if 2 in new else new  # the server stops at <eos>
    assert r.choices[0].text == tok.decode(new, skip_special_tokens=True)
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == len(new)
    assert r.choices[0].finish_reason == ("stop" if 2 in new else "length")


def test_text_prompt_and_stop_string(on: Running) -> None:
    c = client(on)
    full = c.completions.create(model="tiny", prompt="w1 w2 w3 w4", max_tokens=12).choices[0].text
    words = full.split()
    if len(words) < 3:
        pytest.skip("the random model ended its reply too early to place a stop string")
    cut = c.completions.create(model="tiny", prompt="w1 w2 w3 w4", max_tokens=12, stop=[words[2]])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == full[: full.index(words[2])]


def test_streaming_joins_to_the_non_streamed_reply(on: Running) -> None:
    c = client(on)
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "w5 w6 w7 ?"}]
    whole = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=10)
    chunks = list(c.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole.choices[0].message.content
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    streamed = list(c.completions.create(model="tiny", prompt="w9 w8 w7", max_tokens=6, stream=True))
    plain = c.completions.create(model="tiny", prompt="w9 w8 w7", max_tokens=6)
    assert "".join(ch.choices[0].text for ch in streamed) == plain.choices[0].text


def test_sse_ends_with_done(on: Running) -> None:
    body = {"model": "tiny", "prompt": "w3 w4", "max_tokens": 3, "stream": True}
    lines = [x for x in httpx.post(on.url + "/v1/completions", json=body, timeout=30).text.split("\n\n") if x]
    assert lines[-1] == "data: [DONE]"
    assert all(x.startswith("data: ") for x in lines)
    assert json.loads(lines[0][6:])["object"] == "text_completion"


def test_second_chat_turn_reuses_and_equals_the_cache_off_reply(on: Running, off: Running) -> None:
    convs = {}
    for r in (on, off):
        c, msgs, turns = client(r), [{"role": "system", "content": SYSTEM}], []
        for q in ("w11 w12 w13 ?", "w21 w22 ?", "w31 w32 w33 w34 ?"):
            msgs.append({"role": "user", "content": q})
            resp = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=6)
            turns.append(resp)
            msgs.append({"role": "assistant", "content": resp.choices[0].message.content})
        convs[r.url] = turns
    on_turns, off_turns = convs[on.url], convs[off.url]
    assert [t.choices[0].message.content for t in on_turns] == [t.choices[0].message.content for t in off_turns]
    reused = [t.usage.prompt_tokens_details.cached_tokens for t in on_turns]
    # turn 2 resumes at least from turn 1's prompt end (its reply may not re-tokenize the same)
    assert reused[1] >= on_turns[0].usage.prompt_tokens - 1 and reused[2] >= on_turns[1].usage.prompt_tokens - 1
    assert all(t.usage.prompt_tokens_details.cached_tokens == 0 for t in off_turns)
    assert on.metrics()["kvstate_prefix_reused_tokens_total"] >= sum(reused) > 0


def _error(r: httpx.Response) -> dict[str, Any]:
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert "\n" not in body["error"]["message"] and body["error"]["message"]
    return body["error"]  # type: ignore[no-any-return]


LONG = list(range(4, 100)) * 3  # 288 token ids: more than the 256 positions
BAD = [
    ("completions", b'{"model": "tiny", "prompt": ', None, None),
    ("completions", b"[1, 2]", None, None),
    ("completions", {"model": "tiny", "prompt": "w1", "colour": "red"}, "colour", None),
    ("completions", {"model": "tiny", "prompt": "w1", "max_tokens": 0}, "max_tokens", None),
    ("completions", {"model": "tiny", "prompt": "w1", "max_tokens": POSITIONS + 1}, "max_tokens", None),
    ("completions", {"model": "tiny", "prompt": "w1", "max_tokens": "5"}, "max_tokens", None),
    ("completions", {"model": "tiny", "prompt": [1, 2, 128]}, "prompt", None),
    ("completions", {"model": "tiny", "prompt": [1, -3]}, "prompt", None),
    ("completions", {"model": "tiny", "prompt": LONG}, "prompt", "context_length_exceeded"),
    ("completions", {"model": "tiny", "prompt": LONG[:250], "max_tokens": 10}, "max_tokens", "context_length_exceeded"),
    ("completions", {"model": "tiny", "prompt": []}, "prompt", None),
    ("completions", {"model": "tiny", "prompt": ["w1", "w2"]}, "prompt", None),
    ("completions", {"model": "tiny", "prompt": "w1", "temperature": -0.5}, "temperature", None),
    ("completions", {"model": "tiny", "prompt": "w1", "top_p": 0}, "top_p", None),
    ("completions", {"model": "tiny", "prompt": "w1", "top_p": 1.5}, "top_p", None),
    ("completions", {"model": "tiny", "prompt": "w1", "top_k": -2}, "top_k", None),
    ("completions", {"model": "tiny", "prompt": "w1", "repetition_penalty": 0}, "repetition_penalty", None),
    ("completions", {"model": "tiny", "prompt": "w1", "max_tokens": 4, "min_tokens": 5}, "min_tokens", None),
    ("completions", {"model": "tiny", "prompt": "w1", "presence_penalty": 0.5}, "presence_penalty", None),
    ("completions", {"model": "tiny", "prompt": "w1", "echo": True}, "echo", None),
    ("completions", {"model": "tiny", "prompt": "w1", "logprobs": 2, "stream": True}, "logprobs", None),
    ("completions", {"model": "tiny", "prompt": "w1", "logprobs": 21}, "logprobs", None),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "w1"}], "top_logprobs": 2},
     "top_logprobs", None),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "w1"}], "logprobs": True,
                          "top_logprobs": 100}, "top_logprobs", None),
    ("completions", {"model": "tiny", "prompt": "w1", "n": 2}, "n", None),
    ("completions", {"model": "tiny", "prompt": "w1", "stop": ["", "x"]}, "stop", None),
    ("completions", {"model": "other", "prompt": "w1"}, "model", "model_not_found"),
    ("chat/completions", {"model": "tiny", "messages": []}, "messages", None),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "tool", "content": "x"}]}, "messages.0.role", None),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "w1"},
                                                        {"role": "user", "content": "w2"}]}, "messages", None),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": " ".join(["w1"] * 300)}]},
     "messages", "context_length_exceeded"),
]


@pytest.mark.parametrize(("path", "body", "param", "code"), BAD, ids=[f"{i}-{b[0]}" for i, b in enumerate(BAD)])
def test_bad_input_is_an_openai_error_and_the_server_keeps_serving(
    on: Running, path: str, body: Any, param: str | None, code: str | None
) -> None:
    kw: dict[str, Any] = {"content": body, "headers": {"content-type": "application/json"}} \
        if isinstance(body, bytes) else {"json": body}
    r = httpx.post(f"{on.url}/v1/{path}", timeout=30, **kw)
    err = _error(r)
    assert (r.status_code, err["type"], err["param"], err["code"]) == (
        404 if code == "model_not_found" else 400, "invalid_request_error", param, code)
    ok = httpx.post(on.url + "/v1/completions", json={"model": "tiny", "prompt": "w1 w2", "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


def test_a_refusal_never_echoes_a_large_input(on: Running) -> None:
    many = {"model": "tiny", "prompt": "w1", "stop": [f"s{i}" for i in range(100_000)]}
    r = httpx.post(f"{on.url}/v1/completions", json=many, timeout=60)
    message = _error(r)["message"]
    assert r.status_code == 400 and len(r.content) < 1000 and "100,000 in all" in message and "s99999" not in message
    long = {"model": "tiny", "prompt": "w1", "stop": ["", "x" * 100_000]}
    r = httpx.post(f"{on.url}/v1/completions", json=long, timeout=60)
    assert r.status_code == 400 and len(r.content) < 1000 and "100,002 characters" in _error(r)["message"]


def test_a_top_logprobs_refusal_names_top_logprobs(on: Running) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "w1"}], "logprobs": True, "top_logprobs": 100}
    message = _error(httpx.post(f"{on.url}/v1/chat/completions", json=body, timeout=30))["message"]
    assert message.startswith("top_logprobs must be") and "top_logprobs" in message


def test_the_openai_client_sees_a_bad_request(on: Running) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client(on).completions.create(model="tiny", prompt=[1, 500], max_tokens=2)
    assert info.value.status_code == 400 and "vocabulary" in info.value.message


def test_a_request_larger_than_the_cache_budget_is_refused(tiny: tuple[Any, Any]) -> None:
    from kvstate.prefix.engine import SparsePrefixCache

    sc = SparsePrefixCache(tiny[0], 1 << 30).store.config
    budget = sc.checkpoint_bytes + sc.logits_bytes + 40 * sc.kv_bytes_per_token
    for r in serve(tiny, budget_bytes=budget):
        big = httpx.post(r.url + "/v1/completions", json={"model": "tiny", "prompt": "w1 w2", "max_tokens": 60})
        err = _error(big)
        assert (big.status_code, err["code"], err["param"]) == (400, "cache_budget_exceeded", "max_tokens")
        small = httpx.post(r.url + "/v1/completions", json={"model": "tiny", "prompt": "w1 w2", "max_tokens": 4})
        assert small.status_code == 200


def test_a_full_queue_answers_503_at_once(slow: Running) -> None:
    c = client(slow)
    results: list[tuple[int, float, Any]] = []

    def ask() -> None:
        t0 = time.monotonic()
        try:
            r = c.completions.create(model="tiny", prompt="w1 w2 w3", max_tokens=12)
            results.append((200, time.monotonic() - t0, r))
        except openai.APIStatusError as exc:
            results.append((exc.status_code, time.monotonic() - t0, exc.response.json()))

    first = threading.Thread(target=ask)
    first.start()
    deadline = time.monotonic() + 10
    while slow.metrics()["kvstate_running_requests"] < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    burst = [threading.Thread(target=ask) for _ in range(3)]
    for t in burst:
        t.start()
    for t in [first, *burst]:
        t.join(60)
    codes = sorted(code for code, _, _ in results)
    assert codes == [200, 200, 503, 503]
    for code, elapsed, body in results:
        if code == 503:
            assert elapsed < 0.5 and body["error"]["code"] == "queue_full" and body["error"]["type"] == "server_error"
        else:
            assert body.usage.completion_tokens == 12
    assert slow.metrics()['kvstate_requests_total{outcome="queue_full"}'] >= 2


def test_a_client_that_disconnects_mid_stream_stops_its_generation(slow: Running) -> None:
    before = slow.metrics()
    body = {"model": "tiny", "messages": [{"role": "user", "content": "w1 w2"}], "max_tokens": 200, "stream": True}
    with httpx.Client(timeout=30) as c, c.stream("POST", slow.url + "/v1/chat/completions", json=body) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: ")
            if seen == 4:  # the role chunk and three tokens
                break
    deadline = time.monotonic() + 10
    m = slow.metrics()
    while time.monotonic() < deadline and (m['kvstate_requests_total{outcome="cancelled"}'] < 1
                                           or m["kvstate_running_requests"] > 0):
        time.sleep(0.05)
        m = slow.metrics()
    assert m['kvstate_requests_total{outcome="cancelled"}'] == before['kvstate_requests_total{outcome="cancelled"}'] + 1
    assert m["kvstate_running_requests"] == 0 and m["kvstate_prefix_pinned_nodes"] == 0
    generated = m['kvstate_tokens_total{kind="completion"}'] - before['kvstate_tokens_total{kind="completion"}']
    assert 3 <= generated < 100  # stopped long before 200 tokens (10 s at 50 ms a token)
    ok = client(slow).completions.create(model="tiny", prompt="w1", max_tokens=2)
    assert ok.usage.completion_tokens == 2


def test_a_client_that_gives_up_on_a_plain_request_stops_its_generation(slow: Running) -> None:
    before = slow.metrics()['kvstate_requests_total{outcome="cancelled"}']
    body = {"model": "tiny", "prompt": "w1 w2", "max_tokens": 200}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(slow.url + "/v1/completions", json=body, timeout=0.5)
    deadline = time.monotonic() + 10
    m = slow.metrics()
    while time.monotonic() < deadline and m['kvstate_requests_total{outcome="cancelled"}'] <= before:
        time.sleep(0.05)
        m = slow.metrics()
    assert m['kvstate_requests_total{outcome="cancelled"}'] == before + 1 and m["kvstate_prefix_pinned_nodes"] == 0
