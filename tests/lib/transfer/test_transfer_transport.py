"""The producer service over loopback TCP, clients that misbehave, and a real Redis payload store."""

from __future__ import annotations

import json
import shutil
import socket
import struct
import subprocess
import time

import pytest
import torch

from kvstate.models.tiny import tiny_model
from kvstate.transfer.calibrate import CalibrationConfig, calibrate_on
from kvstate.transfer.codec import Codec
from kvstate.transfer.serving import producer_service
from kvstate.transfer.states import continue_logits
from kvstate.transfer.store import MemoryStore, RedisStore, StoreError, open_store, store_key
from kvstate.transfer.transport import ServerConfig, ServerThread, TransportError, fetch_payload


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
def redis_url():  # type: ignore[no-untyped-def]
    """A real redis-server on a free loopback port (``make setup`` installs it); fails with the reason."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server is not installed: run `make setup` (apt-get install -y redis-server)")
    port = _free_port()
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        deadline = time.time() + 10
        while True:
            try:
                RedisStore(url, timeout_s=0.5).close()
                break
            except StoreError as exc:
                if proc.poll() is not None or time.time() > deadline:
                    out = proc.stdout.read().decode(errors="replace") if proc.poll() is not None else ""  # type: ignore[union-attr]
                    pytest.fail(f"redis-server did not start on port {port}: {exc} {out[-500:]}")
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


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
