"""A request's cost is bounded by what the server accepts: text that cannot fit the positions is refused before
it is tokenized (and text is never tokenized past positions + 1), and requests are checked a few at a time,
those waiting counted in the queue's bound."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import pytest

from kvstate.serve.app import _Handlers
from kvstate.serve.config import ServeConfig
from kvstate.serve.generation import Generator
from kvstate.serve.metrics import ServerCounters
from kvstate.serve.policy import BatchPolicy
from kvstate.serve.protocol import ChatRequest, CompletionRequest, RequestError
from kvstate.serve.scheduler import Scheduler
from tests.lib.serve.conftest import POSITIONS, Running, serve


class _Spy:
    """The tokenizer, recording the length of every text it is asked to tokenize and the options."""

    def __init__(self, tok: Any) -> None:
        self.tok, self.calls = tok, []  # type: ignore[var-annotated]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tok, name)

    def __call__(self, text: str, **kw: Any) -> Any:
        self.calls.append((len(text), kw.get("max_length")))
        return self.tok(text, **kw)


def _handlers(tiny: tuple[Any, Any]) -> tuple[_Handlers, _Spy]:
    model, tok = tiny
    h = _Handlers(Generator(model, tok, None), tok, ServeConfig("tiny", budget_bytes=None), Scheduler(1),
                  ServerCounters())
    spy = _Spy(tok)
    h.tok = spy
    return h, spy


def test_text_that_cannot_fit_the_positions_is_refused_before_it_is_tokenized(tiny: tuple[Any, Any]) -> None:
    h, spy = _handlers(tiny)
    big = " ".join(["w5"] * 200_000)  # 599,999 characters, 400,000 of them not spaces: at least 44,445 tokens of at most 9
    with pytest.raises(RequestError, match=r"599,999 characters, at least [\d,]+ tokens") as err:
        h.completion(CompletionRequest(model="tiny", prompt=big))
    assert err.value.code == "context_length_exceeded" and spy.calls == []
    messages = [{"role": "user", "content": big}]
    with pytest.raises(RequestError, match="characters, at least") as err:
        h.chat(ChatRequest(model="tiny", messages=messages))
    assert err.value.param == "messages" and spy.calls == []


def test_text_is_tokenized_no_further_than_positions_plus_one(tiny: tuple[Any, Any]) -> None:
    h, spy = _handlers(tiny)
    over = " ".join(["w5"] * 600)  # under the character bound, over the positions
    with pytest.raises(RequestError, match=f"more than {POSITIONS} tokens"):
        h.completion(CompletionRequest(model="tiny", prompt=over))
    with pytest.raises(RequestError, match=f"more than {POSITIONS} tokens"):
        h.chat(ChatRequest(model="tiny", messages=[{"role": "user", "content": over}]))
    assert [m for _, m in spy.calls] == [POSITIONS + 1, POSITIONS + 1]
    # whitespace this tokenizer drops is not counted: a long but sparse prompt that fits is served
    sparse = "w5" + " " * 100_000 + "w6"
    assert len(h.completion(CompletionRequest(model="tiny", prompt=sparse, max_tokens=2)).prompt_ids) == 3


def test_checks_run_a_few_at_a_time_and_waiting_ones_count_in_the_queue(tiny: tuple[Any, Any]) -> None:
    for running in serve(tiny, max_queue=1, max_preparing=1, policy=BatchPolicy("fifo", 1)):
        _check_gate(running)


def _check_gate(running: Running) -> None:
    h = running.app.state.handlers
    check, release = h.completion, threading.Event()
    active, most = [0], [0]

    def slow(body: Any) -> Any:
        active[0] += 1
        most[0] = max(most[0], active[0])
        release.wait(20)
        active[0] -= 1
        return check(body)

    h.completion = slow
    replies: list[httpx.Response] = []

    def send() -> None:
        body = {"model": "tiny", "prompt": "w1 w2", "max_tokens": 1}
        replies.append(httpx.post(f"{running.url}/v1/completions", json=body, timeout=30))

    threads = [threading.Thread(target=send) for _ in range(2)]  # room: 1 queued + 1 free batch row
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while h.preparing < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    third = httpx.post(f"{running.url}/v1/completions", json={"model": "tiny", "prompt": "w1", "max_tokens": 1},
                       timeout=30)
    release.set()
    for t in threads:
        t.join(30)
    assert third.status_code == 503 and third.json()["error"]["code"] == "queue_full"
    assert sorted(r.status_code for r in replies) == [200, 200] and most[0] == 1
