"""Memory in ``/metrics``: the bytes the running decode batch holds for its requests, and the process's RSS.

Oracles: the batch's measured bytes against each request's own cache measured alone (``cache_nbytes``: KV of
its tokens + its recurrent state) and against the config's accounting (``describe``: bytes per KV token,
bytes of one recurrent state), left padding = (longest row - each row) × bytes per KV token; on a running
server, a reply in flight holds between its prompt's and its prompt + reply's KV and one state, and nothing
once it is over; the RSS gauges agree with ``/proc/self/statm`` and the peak is at least the current.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import httpx
import pytest
import torch

from kvstate.models import ResumableCache, cache_nbytes, describe
from kvstate.serve.batching import BatchBytes, DecodeBatch
from kvstate.serve.policy import BatchPolicy
from tests.lib.serve.conftest import Running, serve


def _prefilled(model: Any, n: int) -> ResumableCache:
    cache = ResumableCache(model.config)
    with torch.no_grad():
        model(input_ids=torch.arange(3, 3 + n).unsqueeze(0), cache=cache, use_cache=True)  # (1, n)
    return cache


def test_the_batch_measures_its_rows_kv_padding_and_states(tiny: tuple[Any, Any]) -> None:
    model, _ = tiny
    info = describe(model.config)
    batch = DecodeBatch(model)
    short, long = _prefilled(model, 10), _prefilled(model, 25)
    assert batch.held == BatchBytes(), batch.held
    batch.add("short", short, 10)
    batch.add("long", long, 25)
    held = batch.held
    assert held.kv + held.recurrent == cache_nbytes(short) + cache_nbytes(long), held
    assert (held.rows, held.kv, held.padding, held.recurrent) == (
        2, 35 * info.kv_bytes_per_token, 15 * info.kv_bytes_per_token, 2 * info.checkpoint_bytes), held
    batch.step({"short": 5, "long": 6})
    assert (batch.held.kv, batch.held.padding) == (37 * info.kv_bytes_per_token, 15 * info.kv_bytes_per_token)
    peak = batch.held.total
    batch.remove("long")  # the padding goes with the longest row
    assert (batch.held.rows, batch.held.kv, batch.held.padding) == (1, 11 * info.kv_bytes_per_token, 0)
    batch.remove("short")
    assert batch.held == BatchBytes() and batch.peak_bytes == peak > 0, (batch.held, batch.peak_bytes)


@pytest.fixture(scope="module")
def slow(tiny):  # type: ignore[no-untyped-def]
    """A batch of one; each decode step takes 50 ms and no reply ends early (no end-of-sequence token)."""
    servers = serve(tiny, policy=BatchPolicy(max_batch=1))
    running = next(servers)
    batch = running.app.state.scheduler._batch
    step = batch.step

    def slow_step(*args: Any, **kwargs: Any) -> Any:
        time.sleep(0.05)
        return step(*args, **kwargs)

    batch.step = slow_step
    running.app.state.generator.eos_ids = frozenset()
    yield running
    servers.close()


def test_a_reply_in_flight_holds_its_kv_and_state_and_nothing_after(slow: Running, tiny: tuple[Any, Any]) -> None:
    info = describe(tiny[0].config)
    prompt, max_tokens = [1] + [3 + i for i in range(30)], 40
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens}
    reply: dict[str, Any] = {}
    worker = threading.Thread(target=lambda: reply.update(httpx.post(slow.url + "/v1/completions", json=body,
                                                                     timeout=60).json()))
    worker.start()
    deadline, m = time.monotonic() + 30, slow.metrics()
    while m["kvstate_batch_requests"] < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
        m = slow.metrics()
    worker.join(60)
    after = slow.metrics()
    kv, padding, recurrent = (m[f'kvstate_batch_bytes{{kind="{k}"}}'] for k in ("kv", "padding", "recurrent"))
    tokens = kv / info.kv_bytes_per_token
    assert m["kvstate_batch_requests"] == 1 and tokens == int(tokens), m
    assert len(prompt) <= tokens < len(prompt) + max_tokens, (tokens, m)
    assert (padding, recurrent) == (0, info.checkpoint_bytes), m
    assert reply["usage"]["completion_tokens"] == max_tokens, reply
    assert [after[f'kvstate_batch_bytes{{kind="{k}"}}'] for k in ("kv", "padding", "recurrent")] == [0, 0, 0], after
    assert after["kvstate_batch_requests"] == 0 and after["kvstate_batch_peak_bytes"] >= kv + recurrent, after


def test_rss_agrees_with_proc_and_the_peak_is_at_least_the_current(slow: Running) -> None:
    m = slow.metrics()
    with open("/proc/self/statm") as f:
        resident = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    rss, peak = m["process_resident_memory_bytes"], m["kvstate_process_peak_resident_memory_bytes"]
    assert 0.5 * resident <= rss <= 2 * resident, (rss, resident)
    assert peak >= rss > 0, (peak, rss)
