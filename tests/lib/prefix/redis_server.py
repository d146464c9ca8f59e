"""A real redis-server for tests: on a free loopback port, killed and restarted on the same port."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

import pytest
import redis


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """A real redis-server on a loopback port that can be killed and restarted on the same port."""

    def __init__(self) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            pytest.fail("redis-server is not installed: run `make setup` (apt-get install -y redis-server)")
        self.exe, self.port = exe, _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.time() + 10
        while True:
            try:
                redis.Redis.from_url(self.url, socket_connect_timeout=0.2).ping()
                return
            except redis.RedisError:
                if self.proc.poll() is not None or time.time() > deadline:
                    pytest.fail(f"redis-server did not start on port {self.port}")
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, socket_timeout=2)


@pytest.fixture
def redis_server():  # type: ignore[no-untyped-def]
    """A started :class:`RedisServer`, stopped after the test."""
    srv = RedisServer()
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()
