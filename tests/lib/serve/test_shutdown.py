"""Shutdown with a deadline: after SIGTERM nothing new is admitted (503 with Retry-After), the requests admitted go on
for ``--shutdown-grace`` seconds, then a stream still running ends with ``finish_reason`` set and an error event, a
non-streamed request with a 503, and the process exits 0 within the grace (plus one second)."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvstate.models import tiny_model
from kvstate.serve.generation import GenerationRequest, Generator
from kvstate.serve.policy import BatchPolicy
from kvstate.serve.sampling import SamplingParams
from kvstate.serve.scheduler import Scheduler, ShuttingDown
from tests.lib.serve.conftest import free_port, word_tokenizer

LONG = SamplingParams(temperature=0.0, ignore_eos=True)  # a reply that runs to its max_tokens


async def _outcome(job: Any) -> tuple[str, Any]:
    while True:
        kind, payload = await asyncio.wait_for(job.events.get(), timeout=60)
        if kind != "delta":
            return kind, payload


def test_close_ends_the_running_reply_and_the_queued_request_at_the_deadline(tiny: tuple[Any, Any]) -> None:
    model, tok = tiny
    scheduler = Scheduler(4, Generator(model, tok, None), BatchPolicy(max_batch=1))

    async def main() -> tuple[Any, ...]:
        scheduler.start()
        try:
            running = scheduler.submit(GenerationRequest((1, 20, 21), max_tokens=200, sampling=LONG))
            queued = scheduler.submit(GenerationRequest((1, 22), max_tokens=5, sampling=LONG))  # the batch is full
            kind, _ = await asyncio.wait_for(running.events.get(), timeout=60)  # the first token is out
            scheduler.close(0.3)
            with pytest.raises(ShuttingDown):
                scheduler.submit(GenerationRequest((1, 23), max_tokens=5, sampling=LONG))
            return kind, await _outcome(running), await _outcome(queued), scheduler.idle
        finally:
            scheduler.stop()

    first, (run_kind, g), (queued_kind, err), idle = asyncio.run(main())
    assert first == "delta" and run_kind == "aborted" and g.finish_reason == "abort" and 1 <= g.completion_tokens < 200
    assert queued_kind == "error" and isinstance(err, ShuttingDown) and "grace (0.3 s)" in str(err)
    assert idle


def test_a_reply_that_ends_within_the_grace_is_whole(tiny: tuple[Any, Any]) -> None:
    model, tok = tiny
    scheduler = Scheduler(4, Generator(model, tok, None))

    async def main() -> tuple[str, Any]:
        scheduler.start()
        try:
            job = scheduler.submit(GenerationRequest((1, 20, 21), max_tokens=4, sampling=LONG))
            scheduler.close(60)
            return await _outcome(job)
        finally:
            scheduler.stop()

    kind, g = asyncio.run(main())
    assert kind == "done" and g.finish_reason == "length" and g.completion_tokens == 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("shutdown") / "tiny"
    tiny_model("qwen3_5", seed=0, max_position_embeddings=4096).save_pretrained(root)
    word_tokenizer().save_pretrained(root)
    return root


def _sse(lines: list[str]) -> list[Any]:
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:]) for line in lines if line.startswith("data: ")]


def test_sigterm_drains_for_the_grace_then_ends_the_stream_and_exits_0(model_dir: Path) -> None:
    grace, port = 1.0, free_port()
    url = f"http://127.0.0.1:{port}"
    srv = subprocess.Popen([sys.executable, "-m", "kvstate.cli", "serve", "--model", str(model_dir), "--port", str(port),
                            "--served-model-name", "tiny", "--shutdown-grace", str(grace)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert srv.poll() is None and time.monotonic() < deadline
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        body = {"model": "tiny", "prompt": "w1 w2 w3", "max_tokens": 4000, "ignore_eos": True}
        lines: list[str] = []
        plain: list[httpx.Response] = []

        def stream() -> None:
            with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
                for line in r.iter_lines():
                    if line:
                        lines.append(line)

        def whole() -> None:
            plain.append(httpx.post(url + "/v1/completions", json=body, timeout=60))

        clients = [threading.Thread(target=stream), threading.Thread(target=whole)]
        for c in clients:
            c.start()
        while len(lines) < 3 and clients[0].is_alive():  # the stream is under way
            time.sleep(0.01)
        signalled = time.monotonic()
        srv.send_signal(signal.SIGTERM)
        time.sleep(0.1)
        late = httpx.post(url + "/v1/completions", json={**body, "max_tokens": 2}, timeout=10)
        code = srv.wait(grace + 5)
        took = time.monotonic() - signalled
        for c in clients:
            c.join(10)
    finally:
        if srv.poll() is None:
            srv.kill()
            srv.wait(10)
    assert late.status_code == 503 and late.headers.get("retry-after") == "1"
    assert late.json()["error"]["code"] == "server_shutting_down"
    assert code == 0 and took <= grace + 1.0, (code, took, srv.stderr.read() if srv.stderr else "")
    events = _sse(lines)
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "server_shutting_down"
    assert events[-3]["choices"][0]["finish_reason"] == "abort" and len(events) > 4  # text streamed before the end
    assert len(plain) == 1 and plain[0].status_code == 503 and plain[0].json()["error"]["code"] == "server_shutting_down"
