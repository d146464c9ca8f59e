"""The producer service over loopback TCP, clients that misbehave, and a real Redis payload store."""

from __future__ import annotations

import json
import socket
import struct
import threading
import time

import pytest
import torch

from kvstate.models.tiny import tiny_model
from kvstate.transfer.calibrate import CalibrationConfig, calibrate_on
from kvstate.transfer.codec import Codec
from kvstate.transfer.payload import PayloadError
from kvstate.transfer.serving import Receiver, consumer_generate, producer_service
from kvstate.transfer.states import continue_logits
from kvstate.transfer.store import MemoryStore, RedisStore, StoreError, open_store, store_key
from kvstate.transfer.transport import (
    ProducerService,
    ProducerUnavailable,
    ServerConfig,
    ServerThread,
    TransportError,
    fetch_payload,
    hello,
)
from tests.lib.prefix.redis_server import RedisServer, redis_server  # noqa: F401 (fixture)


@pytest.fixture(scope="module")
def pair() -> tuple[torch.nn.Module, torch.nn.Module, Codec]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    p, c = tiny_model("qwen3", seed=0), tiny_model("qwen3", seed=1)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 128, (1, 32), generator=g) for _ in range(4)]
    cfg = CalibrationConfig(rank_k=4, rank_v=4, rank_h=16, patch=1, prefixes=4, length=32, suffix=4, aligner_steps=5)
    codec = calibrate_on(p, c, prompts, cfg)
    torch.set_num_threads(before)
    return p, c, codec


def _frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def test_loopback_round_trip_decodes_like_a_local_payload(pair: tuple) -> None:
    p, c, codec = pair
    ids = list(range(3, 23))
    store = MemoryStore()
    with ServerThread(producer_service(p, codec, store), ServerConfig(timeout_s=5)) as srv:
        got, head = fetch_payload(f"127.0.0.1:{srv.port}", ids, codec.pair, timeout=10)
        again, head2 = fetch_payload(f"127.0.0.1:{srv.port}", ids, codec.pair, timeout=10)
    local = codec.encode(p, torch.tensor([ids]))  # this thread: float sums may round differently
    assert got.to_bytes() == again.to_bytes() == store.get(store_key(codec.pair, got.token_hash))
    assert (head["cached"], head2["cached"], head["bytes"]) == (False, True, len(local.to_bytes()))
    full = torch.tensor([[*ids, 5]])
    a = continue_logits(c, codec.decode(c, got, full[0].tolist()), full, 20)
    b = continue_logits(c, codec.decode(c, local), full, 20)
    assert torch.allclose(a, b, atol=1e-3)


def test_killed_and_malformed_clients_leave_the_server_serving(pair: tuple) -> None:
    p, _, codec = pair
    with ServerThread(producer_service(p, codec, MemoryStore()), ServerConfig(timeout_s=2, max_request_bytes=4096)) as srv:
        addr = ("127.0.0.1", srv.port)
        with socket.create_connection(addr) as s:  # dies in the middle of a frame
            s.sendall(struct.pack(">I", 1000) + b'{"op": "enc')
        with socket.create_connection(addr) as s:  # asks, then vanishes before reading the payload
            s.sendall(_frame(json.dumps({"op": "encode", "ids": list(range(30))}).encode()))
        with socket.create_connection(addr) as s:  # garbage, then an oversized frame
            s.sendall(_frame(b"not json"))
            assert json.loads(s.recv(4096)[4:])["ok"] is False
            s.sendall(struct.pack(">I", 10**9))
            assert b"exceeds the limit" in s.recv(4096)
        with socket.create_connection(addr) as s:  # valid JSON, invalid ids
            s.sendall(_frame(json.dumps({"op": "encode", "ids": [-1, "x"]}).encode()))
            assert b"outside the vocabulary" in s.recv(4096)
        with socket.create_connection(addr) as s:  # a stalled client is timed out, not waited for
            s.sendall(struct.pack(">I", 50))
            s.settimeout(10)
            t0 = time.perf_counter()
            assert s.recv(10) == b"" and time.perf_counter() - t0 < 8
        payload, _ = fetch_payload(f"127.0.0.1:{srv.port}", list(range(12)), codec.pair, timeout=10)
        assert payload.n_tokens == 12
        with pytest.raises(TransportError, match="model pair"):
            fetch_payload(f"127.0.0.1:{srv.port}", list(range(12)), b"x" * 32, timeout=10)


def test_unreachable_server_and_bad_address_raise() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening
    with pytest.raises(TransportError, match="cannot reach"):
        fetch_payload(f"127.0.0.1:{port}", [1, 2], timeout=2)
    for bad in ("nowhere", "localhost:²", "localhost:+80"):  # "²".isdigit() is True, int("²") raises
        with pytest.raises(TransportError, match="HOST:PORT"):
            fetch_payload(bad, [1, 2])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:  # noqa: F811 (the shared fixture, by name)
    return redis_server.url


def test_redis_store_round_trip_with_a_real_server(redis_url: str, pair: tuple) -> None:
    p, _, codec = pair
    store = open_store(redis_url)
    assert isinstance(store, RedisStore)
    key = store_key(codec.pair, b"\x01" * 32)
    assert store.get(key) is None
    store.put(key, b"\x00payload\xff")
    assert open_store(redis_url).get(key) == b"\x00payload\xff"  # a second client (another machine) sees it
    with ServerThread(producer_service(p, codec, store)) as srv:
        first, h1 = fetch_payload(f"127.0.0.1:{srv.port}", list(range(16)), codec.pair)
    with ServerThread(producer_service(p, codec, open_store(redis_url))) as srv:  # a second producer
        second, h2 = fetch_payload(f"127.0.0.1:{srv.port}", list(range(16)), codec.pair)
    assert (h1["cached"], h2["cached"]) == (False, True) and first.to_bytes() == second.to_bytes()


def test_redis_killed_mid_request_is_one_clear_error_and_the_server_serves_on(redis_server: RedisServer,  # noqa: F811
                                                                               pair: tuple) -> None:
    p, _, codec = pair

    def encode_while_redis_dies(ids: list[int]):  # type: ignore[no-untyped-def]
        redis_server.stop()  # Redis goes away after the lookup missed, before the payload is stored
        return codec.encode(p, torch.tensor([ids]), check=False)

    service = ProducerService(encode_while_redis_dies, codec.pair, RedisStore(redis_server.url, timeout_s=1.0))
    with ServerThread(service, ServerConfig(timeout_s=10)) as srv:
        addr = f"127.0.0.1:{srv.port}"
        with pytest.raises(ProducerUnavailable, match=r"failed on 'encode'.*Redis store .* failed on SET"):
            fetch_payload(addr, list(range(8)), codec.pair, timeout=20)
        with pytest.raises(ProducerUnavailable, match=r"failed on GET .*redis-server still running"):
            fetch_payload(addr, list(range(9)), codec.pair, timeout=20)  # Redis still down: the lookup fails
        assert hello(addr)["pair"] == codec.pair.hex()  # the server lives on and answers other clients
        redis_server.start()  # back on the same port: the same server serves from it again
        service._encode = lambda ids: codec.encode(p, torch.tensor([ids]), check=False)
        _, h1 = fetch_payload(addr, list(range(8)), codec.pair, timeout=20)
        _, h2 = fetch_payload(addr, list(range(8)), codec.pair, timeout=20)
    assert (h1["cached"], h2["cached"], service.served) == (False, True, 2)


class _Tok:
    """A tokenizer stand-in for the tiny models: one id per space-separated number."""

    eos_token_id = 0

    def __call__(self, text: str) -> dict:
        return {"input_ids": [int(w) for w in text.split()]}

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return " ".join(map(str, ids))


def test_consumer_falls_back_to_its_own_prefill_when_the_producer_is_unreachable(pair: tuple) -> None:
    _, c, codec = pair
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"  # bound, never listening
    prompt = " ".join(str(i) for i in range(3, 40))
    gen = consumer_generate(c, _Tok(), codec, dead, prompt, max_new_tokens=4, timeout=5)
    with torch.inference_mode():
        own = c.generate(torch.tensor([list(range(3, 40))]), max_new_tokens=4, do_sample=False, eos_token_id=0,
                         pad_token_id=0)[0, 37:].tolist()
    assert gen.fallback is not None and "cannot reach the producer" in gen.fallback
    assert "prefilled on the consumer instead" in gen.fallback
    assert (gen.text, gen.payload_bytes, gen.cached) == (" ".join(map(str, own)), 0, False)
    with pytest.raises(ProducerUnavailable, match="cannot reach"):
        consumer_generate(c, _Tok(), codec, dead, prompt, max_new_tokens=4, timeout=5, fallback=False)


def test_a_refused_request_is_not_hidden_by_the_fallback(pair: tuple) -> None:
    p, c, codec = pair
    other = Receiver(b"y" * 32, lambda payload, ids: None)  # a consumer whose codec is for another pair
    with ServerThread(producer_service(p, codec, MemoryStore())) as srv:
        with pytest.raises(TransportError, match="model pair") as err:
            consumer_generate(c, _Tok(), other, f"127.0.0.1:{srv.port}", "3 4 5 6", max_new_tokens=1, timeout=10)
        gen = consumer_generate(c, _Tok(), codec, f"127.0.0.1:{srv.port}", "3 4 5 6 7", max_new_tokens=2, timeout=10)
    assert not isinstance(err.value, ProducerUnavailable)
    assert gen.fallback is None and gen.payload_bytes > 0 and gen.new_tokens == 2


def test_the_gate_falls_back_on_a_transfer_it_refuses_and_serves_one_it_accepts(pair: tuple) -> None:
    """p and c have unrelated weights, so the codec's cache is far from c's own: a strict gate refuses it and the
    reply is the consumer's own prefill; a gate that accepts any error serves the payload."""
    from kvstate.transfer.gate import GateConfig, GateRefused

    p, c, codec = pair
    prompt = " ".join(str(i) for i in range(3, 40))
    with torch.inference_mode():
        own = c.generate(torch.tensor([list(range(3, 40))]), max_new_tokens=3, do_sample=False, eos_token_id=0,
                         pad_token_id=0)[0, 37:].tolist()
    with ServerThread(producer_service(p, codec, MemoryStore())) as srv:
        addr = f"127.0.0.1:{srv.port}"
        strict = consumer_generate(c, _Tok(), codec, addr, prompt, 3, 10, gate=GateConfig(tokens=8, max_error=0.01))
        loose = consumer_generate(c, _Tok(), codec, addr, prompt, 3, 10, gate=GateConfig(tokens=8, max_error=1e9))
        with pytest.raises(GateRefused, match="K/V error"):
            consumer_generate(c, _Tok(), codec, addr, prompt, 3, 10, fallback=False,
                              gate=GateConfig(tokens=8, max_error=0.01))
    assert strict.fallback is not None and "the gate refused" in strict.fallback and strict.payload_bytes == 0
    assert strict.text == " ".join(map(str, own)) and strict.gate_error is not None and strict.gate_error > 0.01
    assert loose.fallback is None and loose.payload_bytes > 0 and loose.gate_error == strict.gate_error
    assert loose.gate_ms > 0


def test_store_keys_keep_encodings_apart() -> None:
    pair, h = b"p" * 32, b"h" * 32
    keys = {store_key(pair, h), store_key(pair, h, "raw"), store_key(pair, h, "kv4bit")}
    assert len(keys) == 3 and store_key(pair, h) == f"kvstate:payload:{pair.hex()}:{h.hex()}"
    for bad in ("a:b", "x" * 65, "ü"):
        with pytest.raises(StoreError, match="variant"):
            store_key(pair, h, bad)
    with pytest.raises(StoreError, match="variant"):
        ProducerService(lambda ids: None, pair, MemoryStore(), variant="no spaces")  # type: ignore[arg-type,return-value]


def test_unreachable_redis_and_unknown_store_raise() -> None:
    with pytest.raises(StoreError, match="cannot reach the Redis store"):
        RedisStore(f"redis://127.0.0.1:{_free_port()}/0", timeout_s=0.5)
    with pytest.raises(StoreError, match="memory://"):
        open_store("s3://bucket")


def test_memory_store_evicts_least_recently_used() -> None:
    s = MemoryStore(max_bytes=10)
    s.put("a", b"12345")
    s.put("b", b"12345")
    assert s.get("a") == b"12345"
    s.put("c", b"123")
    assert (s.get("a"), s.get("b"), s.get("c")) == (b"12345", None, b"123")


def _ask(sock: socket.socket, body: bytes) -> dict:
    sock.sendall(_frame(body))
    head = b""
    while len(head) < 4:
        head += sock.recv(4 - len(head))
    (n,) = struct.unpack(">I", head)
    data = b""
    while len(data) < n:
        data += sock.recv(n - len(data))
    return json.loads(data)


@pytest.mark.parametrize(("body", "needle"), [
    (json.dumps({"op": "encode", "ids": [1, 2, 10**6]}).encode(), "outside the vocabulary"),
    (json.dumps({"op": "encode", "ids": [1.0, 2.5]}).encode(), "not an int"),
    (json.dumps({"op": "encode", "ids": [5] * 600}).encode(), "600 token ids"),
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (json.dumps({"op": "drop"}).encode(), "unknown op"),
])
def test_bad_requests_get_an_error_reply_and_the_connection_lives_on(pair: tuple, body: bytes, needle: str) -> None:
    p, _, codec = pair
    assert p.config.max_position_embeddings >= 600
    service = producer_service(p, codec, MemoryStore())
    service.max_tokens = 512  # the producer's positions, lowered so that the bound is cheap to reach
    with ServerThread(service, ServerConfig(timeout_s=5)) as srv, \
            socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
        reply = _ask(s, body)
        assert reply["ok"] is False and needle in reply["error"]
        assert _ask(s, b'{"op": "hello"}')["ok"] is True  # not a dropped connection
    assert service.served == 0


def test_the_service_bounds_requests_by_the_producer(pair: tuple) -> None:
    p, _, codec = pair
    service = producer_service(p, codec, MemoryStore())
    assert (service.vocab_size, service.max_tokens) == (p.config.vocab_size, p.config.max_position_embeddings)


def _flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1:]


@pytest.mark.parametrize("backend", ["memory", "redis"])
def test_a_corrupt_stored_payload_is_deleted_counted_and_encoded_again(pair: tuple, backend: str,
                                                                        request: pytest.FixtureRequest) -> None:
    p, _, codec = pair
    store = MemoryStore() if backend == "memory" else open_store(request.getfixturevalue("redis_url"))
    service = producer_service(p, codec, store)
    ids, other = list(range(3, 15)), list(range(20, 32))
    with ServerThread(service, ServerConfig(timeout_s=5)) as srv:
        addr = f"127.0.0.1:{srv.port}"
        good, _ = fetch_payload(addr, ids, codec.pair, timeout=10)
        key = store_key(codec.pair, good.token_hash)
        store.put(key, _flip(good.to_bytes(), len(good.to_bytes()) // 2))  # a bit flipped in the store
        again, head = fetch_payload(addr, ids, codec.pair, timeout=10)
        assert head["cached"] is False and again.to_bytes() == good.to_bytes() and service.corrupt == 1
        assert store.get(key) == good.to_bytes()  # the bad entry was replaced by a good one
        wrong, _ = fetch_payload(addr, other, codec.pair, timeout=10)
        store.put(key, wrong.to_bytes())  # whole and checksummed, but for other tokens
        third, head = fetch_payload(addr, ids, codec.pair, timeout=10)
        assert head["cached"] is False and third.to_bytes() == good.to_bytes() and service.corrupt == 2
        _, head = fetch_payload(addr, ids, codec.pair, timeout=10)
        assert head["cached"] is True and service.corrupt == 2


def _corrupting(service: ProducerService) -> ProducerService:
    """``service`` with every payload corrupted on its way out (in transit, after the producer's checks)."""
    serve = service.payload_bytes
    service.payload_bytes = lambda ids: (_flip(serve(ids)[0], 200), False)  # type: ignore[method-assign]
    return service


def test_consumer_falls_back_on_a_corrupt_payload_only_when_asked(pair: tuple) -> None:
    p, c, codec = pair
    prompt = " ".join(str(i) for i in range(3, 40))
    with ServerThread(_corrupting(producer_service(p, codec, MemoryStore())), ServerConfig(timeout_s=5)) as srv:
        addr = f"127.0.0.1:{srv.port}"
        gen = consumer_generate(c, _Tok(), codec, addr, prompt, max_new_tokens=4, timeout=10)
        with pytest.raises(PayloadError, match="checksum"):
            consumer_generate(c, _Tok(), codec, addr, prompt, max_new_tokens=4, timeout=10, fallback=False)
    with torch.inference_mode():
        own = c.generate(torch.tensor([list(range(3, 40))]), max_new_tokens=4, do_sample=False, eos_token_id=0,
                         pad_token_id=0)[0, 37:].tolist()
    assert gen.fallback is not None and "checksum" in gen.fallback and "\n" not in gen.fallback
    assert (gen.text, gen.payload_bytes) == (" ".join(map(str, own)), 0)


def _raw_server(reply: bytes) -> tuple[socket.socket, threading.Thread]:
    """A listening socket that answers the first request frame of one client with ``reply`` as a frame."""
    listener = socket.create_server(("127.0.0.1", 0))

    def answer() -> None:
        conn, _ = listener.accept()
        with conn:
            (n,) = struct.unpack(">I", conn.recv(4))
            while n > 0:
                n -= len(conn.recv(n))
            conn.sendall(_frame(reply))
            conn.recv(1)  # until the client closes

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    return listener, thread


def test_a_reply_that_is_not_utf8_is_a_transport_error() -> None:
    listener, thread = _raw_server(b'{"ok": "\xff\xfe"}')
    with listener:
        with pytest.raises(TransportError, match="malformed reply"):
            fetch_payload(f"127.0.0.1:{listener.getsockname()[1]}", [1, 2], timeout=5)
        thread.join(5)
