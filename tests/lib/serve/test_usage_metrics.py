"""Hit rates a standard client reads: ``usage.prompt_tokens_details.cached_tokens`` and vLLM's prefix-cache counters.

Oracles: before each request the prefix cache is asked where that prompt would resume (``lookup``: it neither
computes nor records), and the reply's ``cached_tokens`` must be that position (0 for a first sighting, > 0 for
the second); the store's own ``kvstate_prefix_reused_tokens`` moves by the same amount; the vLLM counters
``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits`` move by exactly the prompt tokens / the restored
tokens. A streamed reply's usage chunk (``stream_options.include_usage``) equals the non-streamed usage of the
same request on the same cache state; without a prefix cache ``cached_tokens`` is 0 and nothing is counted.
"""

from __future__ import annotations

import json
from itertools import pairwise
from typing import Any

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from kvstate.serve.protocol import ChatRequest
from tests.lib.serve.conftest import Running, serve

QUERIES, HITS = "vllm:prefix_cache_queries", "vllm:prefix_cache_hits"


@pytest.fixture(scope="module")
def on(tiny):  # type: ignore[no-untyped-def]
    yield from serve(tiny)


@pytest.fixture(scope="module")
def off(tiny):  # type: ignore[no-untyped-def]
    yield from serve(tiny, budget_bytes=None)


def samples(r: Running) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of ``/metrics``, parsed by prometheus_client's own text parser, by (name, sorted labels)."""
    text = httpx.get(r.url + "/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def vllm_counter(r: Running, name: str) -> float:
    """A vLLM counter's one sample, labelled as vLLM labels it."""
    return samples(r)[(f"{name}_total", (("engine", "0"), ("model_name", "tiny")))]


def reused(r: Running) -> float:
    return samples(r)[("kvstate_prefix_reused_tokens_total", ())]


def resumes_at(r: Running, ids: list[int]) -> int:
    """Prompt tokens the server's prefix cache would restore for ``ids`` now."""
    cache = r.app.state.generator.cache
    return int(cache.lookup(torch.tensor([ids]), full_state=True).position)


def post(r: Running, path: str, body: dict[str, Any]) -> dict[str, Any]:
    resp = httpx.post(r.url + path, json={"model": "tiny", **body}, timeout=60)
    assert resp.status_code == 200, resp.text
    out: dict[str, Any] = resp.json()
    return out


def stream_usage(r: Running, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The usage of a streamed reply: its last chunk before ``[DONE]``, which must have no choices."""
    body = {"model": "tiny", **body, "stream": True, "stream_options": {"include_usage": True}}
    events = [x for x in httpx.post(r.url + path, json=body, timeout=60).text.split("\n\n") if x]
    assert events[-1] == "data: [DONE]", events[-3:]
    last = json.loads(events[-2].removeprefix("data: "))
    assert last["choices"] == [] and "usage" in last, last
    usage: dict[str, Any] = last["usage"]
    return usage


def cached(usage: dict[str, Any]) -> int:
    return int(usage["prompt_tokens_details"]["cached_tokens"])


def chat_ids(r: Running, messages: list[dict[str, str]]) -> list[int]:
    """The prompt the server builds for ``messages`` (its own template and tokenizer)."""
    req = ChatRequest.model_validate({"model": "tiny", "messages": messages, "max_tokens": 4})
    return list(r.app.state.handlers.chat(req).prompt_ids)


def test_a_repeated_completion_reports_what_the_store_restored(on: Running) -> None:
    prompt = [1] + [3 + (i * 7) % 120 for i in range(40)]
    first_at = resumes_at(on, prompt)
    q0, h0, s0 = vllm_counter(on, QUERIES), vllm_counter(on, HITS), reused(on)
    first = post(on, "/v1/completions", {"prompt": prompt, "max_tokens": 5})["usage"]
    second_at = resumes_at(on, prompt)
    q1, h1, s1 = vllm_counter(on, QUERIES), vllm_counter(on, HITS), reused(on)
    second = post(on, "/v1/completions", {"prompt": prompt, "max_tokens": 5})["usage"]
    q2, h2, s2 = vllm_counter(on, QUERIES), vllm_counter(on, HITS), reused(on)
    assert cached(first) == first_at == 0 and first["prompt_tokens"] == len(prompt), (first, first_at)
    assert cached(second) == second_at > 0, (second, second_at)
    assert (q1 - q0, q2 - q1) == (len(prompt), len(prompt)), (q0, q1, q2)
    assert (h1 - h0, h2 - h1) == (0, cached(second)), (h0, h1, h2)
    assert (s1 - s0, s2 - s1) == (0, cached(second)), "the store's own count of restored tokens disagrees"


def test_a_repeated_chat_reports_what_the_store_restored(on: Running) -> None:
    messages = [{"role": "system", "content": "w40 w41 w42 w43 w44 w45 w46 w47 w48 w49"},
                {"role": "user", "content": "w50 w51 w52 ?"}]
    ids = chat_ids(on, messages)
    usages, predicted, hits = [], [], [vllm_counter(on, HITS)]
    for _ in range(2):
        predicted.append(resumes_at(on, ids))
        usages.append(post(on, "/v1/chat/completions", {"messages": messages, "max_tokens": 4})["usage"])
        hits.append(vllm_counter(on, HITS))
    assert [cached(u) for u in usages] == predicted and predicted[1] > 0, (usages, predicted)
    assert [u["prompt_tokens"] for u in usages] == [len(ids), len(ids)], usages
    assert [b - a for a, b in pairwise(hits)] == predicted, hits


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_the_streamed_usage_equals_the_non_streamed_usage(on: Running, path: str) -> None:
    if path == "/v1/completions":
        body: dict[str, Any] = {"prompt": [1] + [5 + (i * 11) % 110 for i in range(30)], "max_tokens": 6}
        ids = body["prompt"]
    else:
        body = {"messages": [{"role": "user", "content": "w60 w61 w62 w63 w64 w65 w66 w67 ?"}], "max_tokens": 6}
        ids = chat_ids(on, body["messages"])
    post(on, path, body)  # the first sighting: what the next two restore is stored now
    plain_at = resumes_at(on, ids)
    plain = post(on, path, body)["usage"]
    streamed_at = resumes_at(on, ids)
    h0 = vllm_counter(on, HITS)
    streamed = stream_usage(on, path, body)
    assert plain_at == streamed_at > 0, (plain_at, streamed_at)
    assert streamed == plain and cached(streamed) == streamed_at, (streamed, plain)
    assert vllm_counter(on, HITS) - h0 == cached(streamed)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_without_a_prefix_cache_nothing_is_cached_or_counted(off: Running, path: str) -> None:
    body: dict[str, Any] = ({"prompt": [1] + [3 + (i * 5) % 120 for i in range(30)], "max_tokens": 4}
                            if path == "/v1/completions" else
                            {"messages": [{"role": "user", "content": "w70 w71 w72 ?"}], "max_tokens": 4})
    before = (vllm_counter(off, QUERIES), vllm_counter(off, HITS))
    usages = [post(off, path, body)["usage"], post(off, path, body)["usage"], stream_usage(off, path, body)]
    assert [cached(u) for u in usages] == [0, 0, 0] and usages[2] == usages[1], usages
    assert usages[0]["prompt_tokens"] > 0, usages
    assert (vllm_counter(off, QUERIES), vllm_counter(off, HITS)) == before == (0.0, 0.0)
    assert samples(off)[("kvstate_prefix_cache_enabled", ())] == 0.0
