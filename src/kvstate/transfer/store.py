"""Payload stores keyed by (model pair, prefix hash): in-process by default, Redis to share across machines.

Part of the serving side of *Semantic Cache Distillation: Efficient State Transfer via Reuse and
Selective Patching* (``docs/techniques.md#across-models``): many producers and consumers share encoded
prefixes, so a producer looks a payload up before prefilling it again. Three verbs with whole-or-nothing
effects — ``get(key)`` (bytes or ``None``), ``put(key, data)`` (a single Redis ``SET``, or one dict
assignment) and ``delete(key)`` (a stored payload found corrupt) — and :func:`open_store` picks the backend from a URL (``memory://``, ``redis://host:port/db``).
Ignored: eviction policy in Redis (configure ``maxmemory-policy`` on the server), authentication beyond the URL.
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections import OrderedDict
from typing import Any, Protocol

from kvstate.errors import KVStateError

KEY_PREFIX = "kvstate:payload:"


class StoreError(KVStateError):
    """A payload store that cannot be opened or reached."""


def store_key(pair: bytes, token_hash: bytes, variant: str = "") -> str:
    """The key of a payload: its model pair, the hash of its prefix's token ids and, when given, the
    encoding ``variant`` (methods that share a pair — raw / kv4bit, REUSE / SCD — must not share entries)."""
    if variant and not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", variant):
        raise StoreError(f"store key variant {variant!r} must be 1..64 letters, digits, '_', '.' or '-'")
    middle = f"{variant}:" if variant else ""
    return f"{KEY_PREFIX}{pair.hex()}:{middle}{token_hash.hex()}"


class PayloadStore(Protocol):
    def get(self, key: str) -> bytes | None: ...
    def put(self, key: str, data: bytes) -> None: ...
    def delete(self, key: str) -> None: ...
    def close(self) -> None: ...


class MemoryStore:
    """Thread-safe in-process store holding at most ``max_bytes`` (least recently used evicted first)."""

    def __init__(self, max_bytes: int = 1 << 30) -> None:
        if max_bytes < 1:
            raise StoreError(f"MemoryStore max_bytes={max_bytes} must be >= 1")
        self.max_bytes, self._used = max_bytes, 0
        self._data: OrderedDict[str, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> bytes | None:
        with self._lock:
            data = self._data.get(key)
            if data is not None:
                self._data.move_to_end(key)
            return data

    def put(self, key: str, data: bytes) -> None:
        if len(data) > self.max_bytes:
            return  # larger than the whole store: not cached
        with self._lock:
            old = self._data.pop(key, None)
            self._used -= len(old) if old is not None else 0
            while self._data and self._used + len(data) > self.max_bytes:
                self._used -= len(self._data.popitem(last=False)[1])
            self._data[key] = bytes(data)
            self._used += len(data)

    def delete(self, key: str) -> None:
        with self._lock:
            old = self._data.pop(key, None)
            self._used -= len(old) if old is not None else 0

    def close(self) -> None:
        with self._lock:
            self._data.clear()
            self._used = 0


class RedisStore:
    """Payloads in Redis (``redis://host:port/db``); each entry expires after ``ttl_s`` (None: never)."""

    def __init__(self, url: str, ttl_s: int | None = 3600, timeout_s: float = 5.0) -> None:
        try:
            import redis
        except ImportError:
            raise StoreError("--store redis://... needs the redis package: pip install 'kvstate[redis]'") from None
        self._errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
        self.url, self.ttl_s = url, ttl_s
        try:
            self._client: Any = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
            self._client.ping()
        except (*self._errors, ValueError) as exc:
            raise StoreError(f"cannot reach the Redis store {url!r}: {exc}; start redis-server or fix the URL") from None

    def get(self, key: str) -> bytes | None:
        try:
            data = self._client.get(key)
        except self._errors as exc:
            raise StoreError(f"Redis store {self.url!r} failed on GET ({exc}); is redis-server still running? "
                             "restart it, or serve with --store memory://") from None
        return None if data is None else bytes(data)

    def put(self, key: str, data: bytes) -> None:
        try:
            self._client.set(key, data, ex=self.ttl_s)
        except self._errors as exc:
            raise StoreError(f"Redis store {self.url!r} failed on SET ({exc}); is redis-server still running? "
                             "restart it, or serve with --store memory://") from None

    def delete(self, key: str) -> None:
        try:
            self._client.delete(key)
        except self._errors as exc:
            raise StoreError(f"Redis store {self.url!r} failed on DEL ({exc}); is redis-server still running? "
                             "restart it, or serve with --store memory://") from None

    def close(self) -> None:
        with contextlib.suppress(*self._errors):
            self._client.close()


def open_store(url: str | None) -> PayloadStore:
    """``None`` / ``memory://`` -> :class:`MemoryStore`; ``redis://...`` / ``rediss://...`` -> :class:`RedisStore`."""
    if url is None or url == "memory://":
        return MemoryStore()
    if url.startswith(("redis://", "rediss://", "unix://")):
        return RedisStore(url)
    raise StoreError(f"--store {url!r}: use memory:// (default) or redis://HOST:PORT/DB")
