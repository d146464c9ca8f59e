"""A producer service and a consumer client over TCP (asyncio streams, length-prefixed frames).

The network half of *Semantic Cache Distillation: Efficient State Transfer via Reuse and Selective
Patching* (``docs/techniques.md#across-models``): a prefill producer encodes prompts into payloads
(:mod:`kvstate.transfer.payload`) and a decode consumer fetches them. Every message is a frame:
a 4-byte big-endian length, then the body. A request is one JSON frame
(``{"op": "hello"}`` or ``{"op": "encode", "ids": [...]}``); a reply is a JSON frame
(``{"ok": true, ...}`` / ``{"ok": false, "error": ...}``) followed, for ``encode``, by one payload frame.
Requests are bounded (bytes, JSON nesting, tokens: the smaller of ``ServerConfig.max_tokens`` and the
service's own limit, the producer's positions), token ids are checked against the producer's vocabulary,
every read and write has a timeout, the model runs one request at a time in a worker thread (so the
token bound is also the bound on how long one request holds the model), and every bad request gets an
error reply (``{"ok": false, "error": ..., "kind": ...}``), never a dropped connection; a client that stalls
or disconnects mid-frame only loses its own connection. ``kind`` tells the client whose fault it was:
``"request"`` (fix the request), ``"store"`` (the payload store failed, e.g. Redis went away mid-request)
or ``"internal"``; the client raises :class:`ProducerUnavailable` for the last two and for a producer it
cannot reach, so that a consumer can fall back to its own prefill. A payload is verified at both ends
(checksum, model pair, tokens: :class:`~kvstate.transfer.payload.PayloadError` otherwise): the producer
deletes, counts (``ProducerService.corrupt``) and re-encodes a stored payload that fails, never serving
it; the client refuses one that fails on the wire. A reply that is not JSON (or not UTF-8) is a
:class:`TransportError`. Ignored: TLS, authentication, request
multiplexing on one connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvstate.errors import KVStateError
from kvstate.transfer.payload import Payload, PayloadError, ids_hash
from kvstate.transfer.store import PayloadStore, StoreError, store_key
from kvstate.validate import check_float, check_id_list, check_int

_LEN = struct.Struct(">I")


class TransportError(KVStateError):
    """The server cannot be reached, or it answered with an error or a malformed reply."""


class ProducerUnavailable(TransportError):
    """The producer cannot serve now (unreachable, connection lost, its store or model failed): a consumer
    may prefill the prompt itself instead. A refused request or a pair mismatch is a plain TransportError."""


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port (see ServerThread.port)
    max_request_bytes: int = 1 << 20  # one JSON request frame
    max_tokens: int = 32768  # tokens per encode request
    timeout_s: float = 30.0  # per frame read / write

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise TransportError(f"ServerConfig.host={self.host!r} must be a host name or address")
        check_int("ServerConfig.port (--port)", self.port, 0, 65535, error=TransportError)
        check_int("ServerConfig.max_request_bytes", self.max_request_bytes, 64, 1 << 30, error=TransportError)
        check_int("ServerConfig.max_tokens", self.max_tokens, 1, 1 << 24, error=TransportError)
        check_float("ServerConfig.timeout_s", self.timeout_s, 0.0, 86400.0, lo_open=True, error=TransportError)


async def read_frame(reader: asyncio.StreamReader, limit: int, timeout: float) -> bytes:
    head = await asyncio.wait_for(reader.readexactly(_LEN.size), timeout)
    (n,) = _LEN.unpack(head)
    if n > limit:
        raise TransportError(f"frame of {n} bytes exceeds the limit of {limit}")
    return await asyncio.wait_for(reader.readexactly(n), timeout)


async def write_frame(writer: asyncio.StreamWriter, body: bytes, timeout: float) -> None:
    writer.write(_LEN.pack(len(body)) + body)
    await asyncio.wait_for(writer.drain(), timeout)


class ProducerService:
    """What the server runs: ``encode(ids) -> payload bytes`` through a store, one model call at a time.

    ``vocab_size`` / ``max_tokens``: the producer's vocabulary and positions; requests beyond them are
    refused before they reach the model (None: no limit of the service's own)."""

    def __init__(self, encode: Callable[[list[int]], Payload], pair: bytes, store: PayloadStore,
                 info: dict[str, Any] | None = None, *, vocab_size: int | None = None,
                 max_tokens: int | None = None, variant: str = "") -> None:
        self._encode, self.pair, self.store, self.info = encode, pair, store, info or {}
        self.vocab_size, self.max_tokens = vocab_size, max_tokens
        self.variant = variant  # the encoding's name in store keys ("" for the codec's default)
        store_key(pair, b"", variant)  # a bad variant fails here, not on the first request
        self._lock = threading.Lock()
        self.served = 0  # requests answered with a payload
        self.hits = 0  # of which came from the store
        self.corrupt = 0  # stored payloads that failed verification: deleted and encoded again

    def payload_bytes(self, ids: list[int]) -> tuple[bytes, bool]:
        """The payload of ``ids`` and whether it came from the store; a stored payload is served only when it
        parses, its checksum holds and it is for this pair and these tokens (else it is deleted and re-encoded)."""
        key = store_key(self.pair, ids_hash(ids), self.variant)
        data = self.store.get(key)
        if data is not None:
            try:
                Payload.from_bytes(data).check(self.pair, ids)
            except PayloadError:  # corrupted in the store, or written there by something else
                self.store.delete(key)
                self.corrupt += 1
            else:
                self.hits += 1
                return data, True
        with self._lock:
            data = self._encode(ids).to_bytes()
        self.store.put(key, data)
        return data, False


def parse_request(raw: bytes, service: ProducerService, cfg: ServerConfig) -> tuple[str, list[int]]:
    """``("hello", [])`` or ``("encode", ids)`` from one request frame; :class:`ValueError` naming the problem."""
    try:
        req = json.loads(raw)
    except RecursionError:
        raise ValueError("request JSON is nested too deeply; send {'op': 'encode', 'ids': [...]}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"request is not JSON ({exc})") from None
    if not isinstance(req, dict):
        raise ValueError("request must be a JSON object")
    if req.get("op") == "hello":
        return "hello", []
    if req.get("op") != "encode":
        raise ValueError(f"unknown op {str(req.get('op'))[:40]!r}; need {{'op': 'encode', 'ids': [token ids]}} or "
                         "{'op': 'hello'}")
    limit = min(cfg.max_tokens, service.max_tokens or cfg.max_tokens)
    ids = check_id_list("ids", req.get("ids"), service.vocab_size or 2**31, max_len=limit)
    return "encode", ids


def _error(message: str, kind: str) -> bytes:
    return json.dumps({"ok": False, "error": message, "kind": kind}).encode()


async def _handle(service: ProducerService, cfg: ServerConfig, reader: asyncio.StreamReader,
                  writer: asyncio.StreamWriter) -> None:
    loop = asyncio.get_running_loop()
    try:
        while True:
            try:
                raw = await read_frame(reader, cfg.max_request_bytes, cfg.timeout_s)
            except asyncio.IncompleteReadError:
                return  # the client closed (between or inside a frame)
            except TransportError as exc:  # oversized: answer, then drop the connection (its rest is unread)
                await write_frame(writer, _error(str(exc), "request"), cfg.timeout_s)
                return
            try:
                op, ids = parse_request(raw, service, cfg)
                if op == "hello":
                    reply = {"ok": True, "pair": service.pair.hex(), **service.info}
                    await write_frame(writer, json.dumps(reply).encode(), cfg.timeout_s)
                    continue
                t0 = time.perf_counter()
                data, hit = await loop.run_in_executor(None, service.payload_bytes, ids)
                head = {"ok": True, "bytes": len(data), "cached": hit,
                        "encode_ms": round(1e3 * (time.perf_counter() - t0), 3)}
            except StoreError as exc:  # e.g. Redis went away mid-request: this request fails, the server lives on
                await write_frame(writer, _error(str(exc), "store"), cfg.timeout_s)
                continue
            except (ValueError, KVStateError) as exc:
                await write_frame(writer, _error(str(exc), "request"), cfg.timeout_s)
                continue
            except (ConnectionError, TimeoutError):
                raise
            except Exception as exc:  # a bug: the client still gets a reply, the server lives on
                error = f"internal error: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
                await write_frame(writer, _error(error, "internal"), cfg.timeout_s)
                continue
            await write_frame(writer, json.dumps(head).encode(), cfg.timeout_s)
            await write_frame(writer, data, cfg.timeout_s)
            service.served += 1
    except (ConnectionError, TimeoutError, asyncio.IncompleteReadError):
        return  # a stalled or vanished client loses only its own connection
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await writer.wait_closed()


async def start_server(service: ProducerService, cfg: ServerConfig) -> asyncio.Server:
    async def client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _handle(service, cfg, reader, writer)

    try:
        return await asyncio.start_server(client, cfg.host, cfg.port, limit=cfg.max_request_bytes + 8)
    except OSError as exc:
        raise TransportError(f"cannot listen on {cfg.host}:{cfg.port}: {exc}; pick another --port") from None


class ServerThread:
    """Run the server on its own event loop in a daemon thread (``with ServerThread(...) as s: s.port``)."""

    def __init__(self, service: ProducerService, cfg: ServerConfig | None = None) -> None:
        self.service, self.cfg = service, cfg or ServerConfig()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.port = -1
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._server = self._loop.run_until_complete(start_server(self.service, self.cfg))
            self.port = self._server.sockets[0].getsockname()[1]
        except BaseException as exc:
            self._error = exc
            return
        finally:
            self._ready.set()
        self._loop.run_forever()

    def __enter__(self) -> ServerThread:
        self._thread.start()
        self._ready.wait(30)
        if self._error is not None:
            raise self._error
        return self

    def __exit__(self, *exc: object) -> None:
        async def stop() -> None:
            self._server.close()
            await self._server.wait_closed()
            # connection handlers outlive the listening socket: end them while the loop still runs
            handlers = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in handlers:
                t.cancel()
            await asyncio.gather(*handlers, return_exceptions=True)

        if self._error is None:
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        if not self._thread.is_alive():
            self._loop.close()


def parse_address(server: str) -> tuple[str, int]:
    host, sep, port = server.rpartition(":")
    if not sep or not host or re.fullmatch(r"[0-9]+", port) is None or not 0 < int(port) < 65536:
        raise TransportError(f"--server {server!r} must be HOST:PORT, e.g. 127.0.0.1:7070")
    return host, int(port)


async def _request(host: str, port: int, reqs: Sequence[dict[str, Any]], timeout: float,
                   max_payload: int) -> list[tuple[dict[str, Any], bytes | None]]:
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except (TimeoutError, OSError) as exc:
        raise ProducerUnavailable(f"cannot reach the producer at {host}:{port}: {exc or 'timed out'}; "
                                  "start one with `kvstate transfer serve`") from None
    out = []
    try:
        for req in reqs:
            await write_frame(writer, json.dumps(req).encode(), timeout)
            head = json.loads(await read_frame(reader, 1 << 20, timeout))
            if not isinstance(head, dict) or not head.get("ok"):
                failed = isinstance(head, dict) and head.get("kind") in ("store", "internal")
                raise (ProducerUnavailable if failed else TransportError)(
                    f"producer at {host}:{port} {'failed on' if failed else 'refused'} {req.get('op')!r}: "
                    f"{head.get('error') if isinstance(head, dict) else head}")
            body = await read_frame(reader, max_payload, timeout) if req.get("op") == "encode" else None
            out.append((head, body))
    except (TimeoutError, ConnectionError, asyncio.IncompleteReadError) as exc:
        raise ProducerUnavailable(f"connection to the producer at {host}:{port} failed: {exc!r}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:  # not JSON, or not even UTF-8 text
        raise TransportError(f"the producer at {host}:{port} sent a malformed reply ({exc}); is it a kvstate "
                             "transfer server?") from None
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await writer.wait_closed()
    return out


def hello(server: str, timeout: float = 10.0) -> dict[str, Any]:
    """The producer's hello reply (its pair and models): whether it is up and what it serves."""
    host, port = parse_address(server)
    check_float("hello timeout", timeout, 0.0, 86400.0, lo_open=True, error=TransportError)
    [(reply, _)] = asyncio.run(_request(host, port, [{"op": "hello"}], timeout, 0))
    return reply


def fetch_payload(server: str, ids: Sequence[int], pair: bytes | None = None, timeout: float = 60.0,
                  max_payload: int = 1 << 31) -> tuple[Payload, dict[str, Any]]:
    """Ask the producer at ``HOST:PORT`` for the payload of ``ids``; checks the pair first when given.

    Returns the verified payload (checksum, pair when given, tokens; else :class:`PayloadError`) and the reply
    header plus ``"wire_ms"`` (request to last byte)."""
    host, port = parse_address(server)
    ids = check_id_list("fetch_payload ids", list(ids) if isinstance(ids, (list, tuple, range)) else ids, 2**31,
                        error=TransportError)
    check_float("fetch_payload timeout", timeout, 0.0, 86400.0, lo_open=True, error=TransportError)
    t0 = time.perf_counter()
    reqs: list[dict[str, Any]] = [{"op": "hello"}, {"op": "encode", "ids": ids}]
    (hello, _), (head, body) = asyncio.run(_request(host, port, reqs, timeout, max_payload))
    wire_ms = 1e3 * (time.perf_counter() - t0)
    if pair is not None and hello.get("pair") != pair.hex():
        raise TransportError(f"producer at {server} serves model pair {str(hello.get('pair'))[:12]}…, the "
                             f"consumer's codec is for {pair.hex()[:12]}…; point both at the same codec")
    assert body is not None
    payload = Payload.from_bytes(body)
    payload.check(payload.pair if pair is None else pair, ids)
    return payload, {**head, "wire_ms": wire_ms, "hello": hello}
