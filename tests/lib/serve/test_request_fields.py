"""The request fields real load clients send (GuideLLM, inference-perf, vLLM's bench), served with their meaning:
ignore_eos, continuous usage in every chunk, sampling reproducible by seed, logprobs, the accepted-and-ignored
extensions."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.lib.serve.conftest import Running, serve


@pytest.fixture(scope="module")
def on(tiny: tuple[Any, Any]) -> Iterator[Running]:
    yield from serve(tiny)


def _chunks(r: httpx.Response) -> list[dict[str, Any]]:
    lines = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
    assert lines and lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


GUIDELLM = {"model": "tiny", "prompt": "w1 w2 w3 w4 w5", "max_tokens": 9, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}, "stop": None}
GUIDELLM_CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "w1 w2 ?"}], "max_completion_tokens": 9,
                 "stop": None, "ignore_eos": True, "stream": True,
                 "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
INFERENCE_PERF = {"model": "tiny", "prompt": "w7 w8 w9 w10", "max_tokens": 9, "ignore_eos": True, "stream": True,
                  "stream_options": {"include_usage": True}}


@pytest.mark.parametrize(("path", "body"), [("completions", GUIDELLM), ("chat/completions", GUIDELLM_CHAT),
                                            ("completions", INFERENCE_PERF)],
                         ids=["guidellm", "guidellm-chat", "inference-perf"])
def test_the_bodies_load_clients_send_are_served(on: Running, path: str, body: dict[str, Any]) -> None:
    r = httpx.post(f"{on.url}/v1/{path}", json=body, timeout=60)
    assert r.status_code == 200, r.text
    chunks = _chunks(r)
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == 9  # ignore_eos: the reply runs to max_tokens
    if body["stream_options"].get("continuous_usage_stats"):
        counts = [c["usage"]["completion_tokens"] for c in chunks]
        assert all("usage" in c for c in chunks) and counts == sorted(counts) and counts[-1] == 9
    else:
        assert all("usage" not in c for c in chunks[:-1])


def _text(on: Running, **kw: Any) -> str:
    body = {"model": "tiny", "prompt": "w3 w4 w5", "max_tokens": 12, "ignore_eos": True, **kw}
    r = httpx.post(f"{on.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"])


def test_sampling_is_reproducible_by_seed_and_greedy_by_default(on: Running) -> None:
    hot = {"temperature": 1.5, "top_k": 0, "top_p": 1.0}
    assert _text(on, seed=7, **hot) == _text(on, seed=7, **hot)
    assert len({_text(on, seed=s, **hot) for s in range(4)}) >= 2  # a random model at 1.5: seeds differ
    assert _text(on) == _text(on, temperature=0) == _text(on, temperature=0.7, top_k=1)  # the model's default: greedy


def test_logprobs_in_both_response_shapes(on: Running) -> None:
    r = httpx.post(f"{on.url}/v1/completions", timeout=60, json={"model": "tiny", "prompt": "w3 w4", "max_tokens": 5,
                                                                 "ignore_eos": True, "logprobs": 2})
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 5
    assert all(len(t) == 2 and max(t.values()) >= v - 1e-6 for t, v in zip(lp["top_logprobs"], lp["token_logprobs"],
                                                                          strict=True))
    r = httpx.post(f"{on.url}/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": [{"role": "user", "content": "w1"}], "max_tokens": 4, "ignore_eos": True,
        "logprobs": True, "top_logprobs": 3})
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 4 and all(len(c["top_logprobs"]) == 3 and c["logprob"] <= 0 for c in content)


def test_min_tokens_and_the_accepted_and_ignored_extensions(on: Running) -> None:
    r = httpx.post(f"{on.url}/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": "w3", "max_tokens": 6, "min_tokens": 6, "user": "u1", "store": False,
        "metadata": {"k": "v"}, "service_tier": "auto", "repetition_penalty": 1.2, "skip_special_tokens": False,
        "presence_penalty": 0, "frequency_penalty": 0.0, "add_special_tokens": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 6  # end-of-sequence banned until min_tokens


def test_an_unknown_field_is_still_named(on: Running) -> None:
    r = httpx.post(f"{on.url}/v1/completions", timeout=60, json={"model": "tiny", "prompt": "w3", "best_of": 2})
    assert r.status_code == 400 and "best_of" in r.json()["error"]["message"]


def test_cache_events_report_stored_kv_blocks_and_checkpoints(on: Running) -> None:
    before = httpx.get(f"{on.url}/v1/cache/events", timeout=30).json()
    r = httpx.post(f"{on.url}/v1/completions", timeout=60,
                   json={"model": "tiny", "prompt": " ".join(f"w{i}" for i in range(20, 90)), "max_tokens": 2})
    assert r.status_code == 200
    after = httpx.get(f"{on.url}/v1/cache/events", params={"since": before["next"]}, timeout=30).json()
    kinds = {(e["type"], e["kind"]) for e in after["data"]}
    assert {("stored", "kv"), ("stored", "checkpoint")} <= kinds and after["next"] > before["next"]
    assert all(len(h) == 32 for e in after["data"] for h in e["block_hashes"]) and after["dropped"] == 0


def test_a_server_without_a_cache_has_no_cache_events(tiny: tuple[Any, Any]) -> None:
    for running in serve(tiny, budget_bytes=None):
        r = httpx.get(f"{running.url}/v1/cache/events", timeout=30)
        assert r.status_code == 404 and r.json()["error"]["code"] == "no_prefix_cache"


def test_a_cursor_past_the_head_is_refused_naming_the_head_and_epoch(on: Running) -> None:
    now = httpx.get(f"{on.url}/v1/cache/events", timeout=30).json()
    r = httpx.get(f"{on.url}/v1/cache/events", params={"since": 10**30}, timeout=30)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "since" and err["code"] == "cursor_past_head"
    assert f"head {now['next']}" in err["message"] and now["epoch"] in err["message"] and len(err["message"]) < 300
    at_head = httpx.get(f"{on.url}/v1/cache/events", params={"since": now["next"]}, timeout=30)
    assert at_head.status_code == 200 and at_head.json()["next"] == now["next"]
