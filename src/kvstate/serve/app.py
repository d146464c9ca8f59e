"""The FastAPI application: OpenAI's completions and chat completions over one model, plus health and metrics.

A request body over ``--max-body-bytes`` is answered 413 before it is read in full (:class:`BodyLimit`, a
pure ASGI middleware: the declared Content-Length is checked first, a chunked body is counted as it
arrives). Handlers refuse at once (503) when the queue is full, then check the request in a worker thread
off the event loop (tokenize, render the chat template, check token ids, lengths against the model's
positions and the cache's budget), so ``/health`` and other clients' streams keep answering while a long
prompt is tokenized; then they hand a :class:`GenerationRequest` to the :class:`Scheduler`. A non-streaming
handler waits for the worker's result (polling for a client that went away); a streaming one forwards
each text delta as a server-sent event in OpenAI's chunk format and ends with ``data: [DONE]``. A client
that disconnects cancels its job (it stops at the next token and inserts nothing). Every refusal is
OpenAI's error object with a 4xx status (5xx: the queue is full, the server is shutting down, or a bug), and
the server keeps serving.

Shutdown with a deadline (``app.state.drain``, run by :mod:`kvstate.serve.server` at SIGTERM): new requests
get 503 with ``Retry-After`` (and ``/health`` 503, so a load balancer stops routing here), the ones admitted
go on for ``shutdown_grace_s``, then a stream still running ends with a chunk whose ``finish_reason`` is
``"abort"``, an error event and ``[DONE]``, and a non-streamed request gets a 503.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvstate.errors import KVStateError
from kvstate.prefix.config import PrefixCacheConfig
from kvstate.prefix.engine import SparsePrefixCache
from kvstate.serve import chat, logprobs, metrics
from kvstate.serve.config import ServeConfig
from kvstate.serve.generation import Generation, GenerationRequest, Generator
from kvstate.serve.protocol import (
    ChatRequest,
    CompletionRequest,
    RequestError,
    check_unicode,
    error_body,
    validation_message,
)
from kvstate.serve.scheduler import Job, QueueFull, Scheduler, ShuttingDown

log = logging.getLogger("kvstate.serve")
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions
DONE = "data: [DONE]\n\n"
DISCONNECT_POLL_S = 0.25  # how often a non-streaming handler asks whether its client is still there
DRAIN_POLL_S = 0.05  # how often a draining server looks whether every request is over
RETRY_AFTER_S = 1  # the Retry-After of a 503 (queue full, shutting down): another replica, or this one soon


class _ClientGone(Exception):
    pass


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def _usage(g: Generation) -> dict[str, Any]:
    return {
        "prompt_tokens": g.prompt_tokens,
        "completion_tokens": g.completion_tokens,
        "total_tokens": g.prompt_tokens + g.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": g.reused_tokens},
    }


def _shutting_down(exc: ShuttingDown) -> RequestError:
    return RequestError(str(exc), status=503, kind="server_error", code="server_shutting_down",
                        retry_after=RETRY_AFTER_S)


def _aborted(g: Generation, grace: float) -> RequestError:
    return RequestError(f"the server shut down before this reply was complete ({g.completion_tokens} tokens "
                        f"generated when its shutdown grace of {grace:g} s ran out); retry against a running server",
                        status=503, kind="server_error", code="server_shutting_down", retry_after=RETRY_AFTER_S)


def _worker_error(exc: BaseException) -> RequestError:
    if isinstance(exc, RequestError):
        return exc
    if isinstance(exc, ShuttingDown):
        return _shutting_down(exc)
    if isinstance(exc, KVStateError):
        return RequestError(str(exc))
    log.error("generation failed", exc_info=exc)
    return RequestError(f"generation failed ({type(exc).__name__}: {exc}); the server keeps serving",
                        status=500, kind="server_error")


class BodyLimit:
    """ASGI middleware: a request body over ``limit`` bytes is answered 413 (OpenAI's error object) before it is
    read in full (a declared Content-Length at once, a chunked body as soon as its count passes the limit), then
    closes the connection, so the rest is neither held nor read: a huge body costs the server nothing. A client
    still sending sees its write fail and reads the 413 already sent (httpx, hence openai's client, does)."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            await self._refuse(scope, receive, send)
            return
        parts: list[bytes] = []
        size, first = 0, None
        while True:  # the body is read here, counted, and handed on in one message
            message = await receive()
            if message["type"] != "http.request":  # the client went away mid-body
                first = message
                break
            parts.append(message.get("body", b""))
            size += len(parts[-1])
            if size > self.limit:
                await self._refuse(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        pending: list[Message] = [first or {"type": "http.request", "body": b"".join(parts), "more_body": False}]

        async def replay() -> Message:
            return pending.pop() if pending else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = (f"the request body is over {self.limit:,} bytes (--max-body-bytes {self.limit}); send a shorter "
                   "prompt, or start the server with a larger --max-body-bytes")
        response = JSONResponse(error_body(message, "invalid_request_error", None, "request_too_large"),
                                status_code=413, headers={"Connection": "close"})
        await response(scope, receive, send)


class _Handlers:
    """The checks and the hand-off shared by both generation endpoints."""

    def __init__(self, generator: Generator, tokenizer: Any, config: ServeConfig, scheduler: Scheduler,
                 counters: metrics.ServerCounters) -> None:
        self.gen, self.tok, self.config, self.scheduler, self.counters = (
            generator, tokenizer, config, scheduler, counters)
        self.template = chat.template_of(tokenizer, config.chat_template)
        self.controls = chat.control_tokens(tokenizer)
        self.tails: dict[str, str | None] = {}  # each role's closing text in the template (learned once)
        self.chars = chat.CharBound(tokenizer)  # refuses text that cannot fit the positions, before tokenizing
        self.preparing = 0  # requests being checked or waiting to be (counted against --max-queue)
        self.gate: asyncio.Semaphore | None = None  # bounds the checks run at once (made on the event loop)

    # -- checks ------------------------------------------------------------------------------------
    def check_model(self, name: str) -> None:
        if name != self.config.model_id:
            raise RequestError(f"model {name!r} is not served here; pass model={self.config.model_id!r} (see "
                               "/v1/models)", status=404, param="model", code="model_not_found")

    def fits(self, text: str, prompt_param: str) -> int | None:
        """Refuse ``text`` that has more characters than the model's positions can hold in tokens (checked
        before it is tokenized: the cost of a refusal is not the cost of tokenizing it); the most tokens worth
        producing (positions + 1: a prompt that long is refused by :meth:`limits`), None without a limit."""
        pos = self.gen.max_positions
        if pos is None:
            return None
        least = self.chars.least_tokens(text, pos)
        if least >= pos:
            raise RequestError(f"the prompt has {len(text):,} characters, at least {least:,} tokens for this "
                               f"tokenizer, but the model has {pos} positions; shorten it", param=prompt_param,
                               code="context_length_exceeded")
        return pos + 1

    def limits(self, ids: list[int], max_tokens: int | None, param: str, default: int, prompt_param: str,
               cut: bool = False) -> int:
        """``max_tokens`` (named ``param``; ``default`` when None) checked against the model's positions and the
        cache's budget; ``prompt_param`` names the prompt's field; ``cut``: ``ids`` were cut at positions + 1."""
        n, pos = len(ids), self.gen.max_positions
        if max_tokens is not None and (max_tokens < 1 or (pos is not None and max_tokens > pos)):
            raise RequestError(f"{param}={max_tokens} must be in 1..{pos if pos is not None else 'inf'} (the "
                               "model's positions)", param=param)
        if pos is not None and n >= pos:
            count = f"more than {pos}" if cut and n > pos else str(n)
            raise RequestError(f"the prompt has {count} tokens but the model has {pos} positions; shorten it",
                               param=prompt_param, code="context_length_exceeded")
        if max_tokens is None:
            max_tokens = min(default, pos - n) if pos is not None else default
        if pos is not None and n + max_tokens > pos:
            raise RequestError(f"the model has {pos} positions but {n + max_tokens} were requested ({n} in the "
                               f"prompt, {max_tokens} in the reply); lower {param} or shorten the prompt",
                               param=param, code="context_length_exceeded")
        if self.gen.cache is not None:
            need, budget = self.gen.request_bytes(n + max_tokens), self.config.budget_bytes
            if budget is not None and need > budget:
                raise RequestError(f"this request needs about {need:,} bytes of prefix cache ({n} prompt + "
                                   f"{max_tokens} reply tokens), over the cache budget of {budget:,} bytes; "
                                   f"shorten it, lower {param}, or start the server with a larger --budget-bytes",
                                   param=param, code="cache_budget_exceeded")
        return max_tokens

    def completion(self, req: CompletionRequest) -> GenerationRequest:
        self.check_model(req.model)
        req.check_sampling()
        stops = req.stops()
        prompt: Any = req.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise RequestError(f"prompt: this server takes one prompt per request, got {len(prompt)}; send "
                                   "them as separate requests", param="prompt")
            prompt = prompt[0]
        cut = False
        if isinstance(prompt, str):
            check_unicode("prompt", prompt, "prompt")
            add = True if req.add_special_tokens is None else req.add_special_tokens
            most = self.fits(prompt, "prompt")
            bound: dict[str, Any] = {} if most is None else {"truncation": True, "max_length": most}
            ids = list(self.tok(prompt, add_special_tokens=add, **bound)["input_ids"])
            cut = most is not None
        else:
            ids = list(prompt)
            bad = [t for t in ids if not 0 <= t < self.gen.vocab_size]
            if bad:
                raise RequestError(f"prompt: token ids {bad[:5]} are outside the vocabulary 0..{self.gen.vocab_size - 1}",
                                   param="prompt")
        if not ids:
            raise RequestError("prompt: empty; send at least one token", param="prompt")
        param, asked = self.max_tokens_of(req)
        max_tokens = self.limits(ids, asked, param, COMPLETION_DEFAULT_MAX_TOKENS, "prompt", cut)
        return GenerationRequest(tuple(ids), max_tokens, stops, sampling=req.sampling(self.gen.default_sampling, max_tokens),
                                 skip_special_tokens=req.skip_special_tokens)

    def max_tokens_of(self, req: CompletionRequest | ChatRequest) -> tuple[str, int | None]:
        """The reply-length field the request used and its value (``max_tokens`` or ``max_completion_tokens``)."""
        if req.max_tokens is not None and req.max_completion_tokens is not None \
                and req.max_tokens != req.max_completion_tokens:
            raise RequestError("max_tokens and max_completion_tokens differ; pass one of them",
                               param="max_completion_tokens")
        if req.max_completion_tokens is not None:
            return "max_completion_tokens", req.max_completion_tokens
        return "max_tokens", req.max_tokens

    def chat(self, req: ChatRequest) -> GenerationRequest:
        self.check_model(req.model)
        req.check_sampling()
        stops = req.stops()
        if req.add_special_tokens:
            raise RequestError("add_special_tokens=true is not served for chat: the chat template places the special "
                               "tokens; omit it", param="add_special_tokens")
        param, asked = self.max_tokens_of(req)
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                    for m in req.messages]
        for i, m in enumerate(messages):
            check_unicode(f"messages[{i}].content", m["content"], f"messages.{i}.content")
        chat.check_contents(messages, self.controls)
        text = chat.render_text(self.tok, self.template, messages, generation_prompt=True)
        most = self.fits(text, "messages")
        ids, spans = chat.encode(self.tok, text, most)
        if not ids:
            raise RequestError("messages: the chat template renders them to no tokens", param="messages")
        max_tokens = self.limits(ids, asked, param, self.config.default_max_tokens, "messages", most is not None)
        ends = chat.message_ends(self.tok, self.template, messages, ids, text, spans, self.tails) \
            if self.gen.accepts_boundaries else []
        return GenerationRequest(tuple(ids), max_tokens, stops, tuple(ends),
                                 sampling=req.sampling(self.gen.default_sampling, max_tokens),
                                 skip_special_tokens=req.skip_special_tokens)

    # -- hand-off ----------------------------------------------------------------------------------
    def check_room(self) -> None:
        """A 503 at once when every queue slot is taken, by requests waiting in the queue or to be checked (checked
        before tokenizing a request that would be refused)."""
        try:
            self.scheduler.check_room(pending=self.preparing)
        except QueueFull as exc:
            raise self._busy(exc) from None
        except ShuttingDown as exc:
            raise self._closed(exc) from None

    async def prepare(self, check: Callable[[Any], GenerationRequest], body: Any) -> Job:
        """Check ``body`` in a worker thread, at most ``max_preparing`` at once (the others wait, counted in the
        queue), and queue the request it becomes."""
        self.check_room()
        if self.gate is None:
            self.gate = asyncio.Semaphore(self.config.max_preparing)
        self.preparing += 1
        try:
            async with self.gate:
                if self.scheduler.closing:  # the server began to shut down while this request waited its turn
                    self.check_room()
                gr = await run_in_threadpool(check, body)
        finally:
            self.preparing -= 1
        return self.submit(gr)

    def _busy(self, exc: QueueFull) -> RequestError:
        self.counters.outcome("queue_full")
        return RequestError(str(exc), status=503, kind="server_error", code="queue_full", retry_after=RETRY_AFTER_S)

    def _closed(self, exc: ShuttingDown) -> RequestError:
        self.counters.outcome("shutdown")
        return _shutting_down(exc)

    def submit(self, gr: GenerationRequest) -> Job:
        try:
            return self.scheduler.submit(gr)
        except QueueFull as exc:  # filled up while this request was checked
            raise self._busy(exc) from None
        except ShuttingDown as exc:  # the server began to shut down while this request was checked
            raise self._closed(exc) from None

    async def result(self, request: Request, job: Job) -> Generation:
        try:
            checked = time.monotonic()
            while True:
                try:
                    kind, payload = await asyncio.wait_for(job.events.get(), timeout=DISCONNECT_POLL_S)
                except TimeoutError:
                    kind, payload = "", None
                if time.monotonic() - checked >= DISCONNECT_POLL_S:  # text deltas may never let the wait time out
                    checked = time.monotonic()
                    if await request.is_disconnected():
                        raise _ClientGone()
                if kind == "done":
                    return payload  # type: ignore[no-any-return]
                if kind == "error":
                    raise _worker_error(payload)
                if kind == "cancelled":
                    raise _ClientGone()
                if kind == "aborted":
                    raise _aborted(payload, self.config.shutdown_grace_s)
        finally:
            job.cancel()  # a no-op once the job is over; stops it when the client left or the server stops

    async def stream(self, job: Job, chunk: Callable[[str | None, str | None], dict[str, Any]],
                     usage: Callable[[Generation], dict[str, Any]] | None,
                     first: dict[str, Any] | None, continuous_usage: bool = False) -> AsyncIterator[str]:
        prompt = len(job.request.prompt_ids)

        def counted(c: dict[str, Any], done: int) -> dict[str, Any]:  # vLLM's continuous_usage_stats
            if continuous_usage:
                c = {**c, "usage": {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}}
            return c

        try:
            if first is not None:
                yield _sse(counted(first, 0))
            while True:
                kind, payload = await job.events.get()
                if kind == "delta":
                    yield _sse(counted(chunk(payload.text, None), payload.completion_tokens))
                elif kind == "done":
                    yield _sse(counted(chunk(None, payload.finish_reason), payload.completion_tokens))
                    if usage is not None:
                        yield _sse(usage(payload))
                    yield DONE
                    return
                elif kind == "error":
                    yield _sse(_worker_error(payload).body())
                    yield DONE
                    return
                elif kind == "aborted":  # the shutdown deadline: the reason on the last chunk, then why
                    yield _sse(counted(chunk(None, payload.finish_reason), payload.completion_tokens))
                    if usage is not None:
                        yield _sse(usage(payload))
                    yield _sse(_aborted(payload, self.config.shutdown_grace_s).body())
                    yield DONE
                    return
                else:  # cancelled
                    return
        finally:
            job.cancel()  # the client went away (the stream was cancelled), or the job is already over


def create_app(model: Any, tokenizer: Any, config: ServeConfig) -> FastAPI:
    """The server for one loaded model and its tokenizer (see :func:`kvstate.serve.server.run`)."""
    cache = None
    if config.budget_bytes is not None:
        cache = SparsePrefixCache(model, PrefixCacheConfig(config.budget_bytes, remote=config.remote,
                                                           remote_key_file=config.remote_key_file), grid=config.grid)
    generator = Generator(model, tokenizer, cache)
    counters = metrics.ServerCounters()
    scheduler = Scheduler(config.max_queue, generator, config.policy, on_job_end=counters.outcome,
                          on_generation=counters.generation)
    registry = metrics.registry(generator, scheduler, counters, config.model_id)
    h = _Handlers(generator, tokenizer, config, scheduler, counters)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        scheduler.start()
        try:
            yield
        finally:
            scheduler.stop()

    async def drain() -> None:
        """Admit nothing more; let the requests admitted run for ``shutdown_grace_s``, then end the rest; returns
        once every request is over (one still being checked is refused when its check ends)."""
        scheduler.close(config.shutdown_grace_s)
        deadline = time.monotonic() + config.shutdown_grace_s
        while not scheduler.idle or (h.preparing and time.monotonic() < deadline):
            await asyncio.sleep(DRAIN_POLL_S)

    app = FastAPI(title="kvstate serve", lifespan=lifespan)
    app.add_middleware(BodyLimit, limit=config.max_body_bytes)
    app.state.generator, app.state.scheduler, app.state.counters, app.state.handlers, app.state.drain = (
        generator, scheduler, counters, h, drain)

    def refuse(exc: RequestError) -> JSONResponse:
        if exc.status < 500:
            counters.outcome("invalid")
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers())

    @app.exception_handler(RequestError)
    async def _request_error(_: Request, exc: RequestError) -> JSONResponse:
        return refuse(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(list(exc.errors()))
        return refuse(RequestError(message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(error_body(str(exc.detail), kind), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _bug(_: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(_worker_error(exc).body(), status_code=500)

    @app.get("/health")
    async def health() -> Any:
        if scheduler.closing:  # a load balancer stops routing here
            return JSONResponse({"status": "shutting_down", "model": config.model_id, "prefix_cache": cache is not None},
                                status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})
        return {"status": "ok", "model": config.model_id, "prefix_cache": cache is not None}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": config.model_id, "object": "model", "created": created,
                                            "owned_by": "kvstate", "max_model_len": generator.max_positions}]}

    @app.get("/v1/cache/events")
    async def cache_events(since: int = 0, limit: int = 1000) -> dict[str, Any]:
        """The prefix cache's store / evict events after ``since`` (KV blocks and recurrent checkpoints by
        content hash), for a cache-aware router; poll with ``since`` = the last reply's ``next``."""
        if cache is None:
            raise RequestError("this server runs without a prefix cache (--no-cache): it has no cache events",
                               status=404, code="no_prefix_cache")
        if since < 0 or not 1 <= limit <= 10_000:
            raise RequestError(f"since={since} must be >= 0 and limit={limit} in 1..10000", param="since")
        head = cache.events.head
        if since > head:  # a cursor from before a restart (or another replica): echoing it would skip every event
            raise RequestError(f"since={since} is past this log's head {head} (epoch "
                               f"{cache.events.epoch}): the replica restarted or the cursor is another's; "
                               f"resync with since=0", param="since", code="cursor_past_head")
        events, nxt, dropped = cache.events.since(since, limit)
        return {"object": "list", "model": config.model_id, "epoch": cache.events.epoch, "block_size": cache.align,
                "data": [e.as_json() for e in events], "next": nxt, "dropped": dropped}

    @app.get("/metrics")
    async def metrics_text() -> Response:
        return Response(metrics.render(registry), media_type=metrics.CONTENT_TYPE)

    def head(kind: str) -> dict[str, Any]:
        prefix = "chatcmpl" if kind.startswith("chat") else "cmpl"
        return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()),
                "model": config.model_id}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        job = await h.prepare(h.completion, body)
        if body.stream:
            top = head("text_completion")

            def chunk(text: str | None, finish: str | None) -> dict[str, Any]:
                return {**top, "choices": [{"index": 0, "text": text or "", "logprobs": None,
                                            "finish_reason": finish}]}

            return _streaming(h.stream(job, chunk, _usage_chunk(top, body), None, _continuous(body)))
        try:
            g = await h.result(request, job)
        except _ClientGone:
            return Response(status_code=499)
        lp = logprobs.completion(h.tok, g) if body.logprobs is not None else None
        return {**head("text_completion"), "choices": [{"index": 0, "text": g.text, "logprobs": lp,
                                                        "finish_reason": g.finish_reason}], "usage": _usage(g)}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request) -> Any:
        job = await h.prepare(h.chat, body)
        if body.stream:
            top = head("chat.completion.chunk")

            def chunk(text: str | None, finish: str | None) -> dict[str, Any]:
                delta = {} if text is None else {"content": text}
                return {**top, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}

            first = {**top, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                         "logprobs": None, "finish_reason": None}]}
            return _streaming(h.stream(job, chunk, _usage_chunk(top, body), first, _continuous(body)))
        try:
            g = await h.result(request, job)
        except _ClientGone:
            return Response(status_code=499)
        message = {"role": "assistant", "content": g.text}
        lp = logprobs.chat(h.tok, g) if body.logprobs else None
        return {**head("chat.completion"), "choices": [{"index": 0, "message": message, "logprobs": lp,
                                                        "finish_reason": g.finish_reason}], "usage": _usage(g)}

    return app


def _continuous(body: CompletionRequest | ChatRequest) -> bool:
    return body.stream_options is not None and body.stream_options.continuous_usage_stats


def _usage_chunk(top: dict[str, Any], body: CompletionRequest | ChatRequest
                 ) -> Callable[[Generation], dict[str, Any]] | None:
    if body.stream_options is None or not body.stream_options.include_usage:
        return None
    return lambda g: {**top, "choices": [], "usage": _usage(g)}


def _streaming(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
