"""The shared tier's connection: a byte store behind ``get`` / ``put``, and its Redis implementation.

Sparse prefix caching ("Sparse Prefix Caching for Hybrid and Recurrent LLM Serving") across replicas:
every replica writes what it computed through to one remote tier and reads it back on a local miss
(the layout of SGLang's HiCache / LMCache remote backends). This module only moves bytes; what the
keys and payloads are lives in :mod:`kvstate.prefix.shared_tier`. A tier that cannot be reached raises
:class:`RemoteUnavailable` from every verb, so the caller degrades to local-only and retries later.

Ignores: TTLs and memory limits (configure ``maxmemory`` / ``maxmemory-policy allkeys-lru`` on the
Redis server: an evicted entry is a miss), TLS options beyond what the URL carries.
"""

from __future__ import annotations

from typing import Any, Protocol
from urllib.parse import urlparse

from kvstate.errors import KVStateError

SCHEMES = ("redis", "rediss", "unix")


class RemoteUnavailable(KVStateError):
    """The remote tier did not answer (refused, timed out, reset): treat as local-only for now."""


class RemoteTier(Protocol):
    """What the prefix cache needs from a shared tier."""

    def get(self, key: str) -> bytes | None: ...  # None: no such entry (never written, or evicted)

    def put(self, key: str, data: bytes) -> None: ...

    def delete(self, key: str) -> None: ...  # drop an entry a reader refused (best effort)


def check_remote_url(url: str) -> str:
    """``redis://host:port/db`` (or ``rediss://``, ``unix://``): the URL, validated; else a KVStateError."""
    fix = "pass remote='redis://HOST:PORT/DB', e.g. 'redis://127.0.0.1:6379/0'"
    if not isinstance(url, str) or not url:
        raise KVStateError(f"remote={url!r} is not a URL; {fix}.")
    try:
        parts = urlparse(url)
        port = parts.port
    except ValueError as exc:
        raise KVStateError(f"remote={url!r} is not a valid URL ({exc}); {fix}.") from None
    if parts.scheme not in SCHEMES:
        raise KVStateError(f"remote={url!r}: scheme {parts.scheme!r} is not one of {list(SCHEMES)}; {fix}.")
    if parts.scheme != "unix":
        if not parts.hostname:
            raise KVStateError(f"remote={url!r} names no host; {fix}.")
        if port is not None and not 0 < port < 65536:
            raise KVStateError(f"remote={url!r}: port {port} is outside 1..65535; {fix}.")
        db = parts.path.lstrip("/")
        if db and not db.isdigit():
            raise KVStateError(f"remote={url!r}: database {db!r} is not a number; {fix}.")
    try:  # the query's options (socket_timeout=..., ...) as redis-py will read them
        from redis.connection import parse_url

        parse_url(url)
    except ImportError:  # redis-py is a dependency; without it RedisTier says so
        pass
    except (ValueError, TypeError) as exc:
        raise KVStateError(f"remote={url!r}: {' '.join(str(exc).split())}; {fix}.") from None
    return url


class RedisTier:
    """A :class:`RemoteTier` on Redis. Connects lazily and reconnects on the next call after a failure,
    so a Redis that went away and came back is used again without a restart."""

    def __init__(self, url: str, timeout_s: float = 1.0) -> None:
        import redis

        self.url = check_remote_url(url)
        self._errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
        self._client: Any = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry_on_timeout=False
        )

    def ping(self) -> None:
        """Connect and PING now (select the URL's database too); :class:`RemoteUnavailable` naming the URL and
        the error when the tier cannot be used (refused, timed out, not Redis, no such database)."""
        try:
            if not self._client.ping():
                raise RemoteUnavailable(f"remote tier {self.url!r} did not answer PING")
        except self._errors as exc:
            raise RemoteUnavailable(f"remote tier {self.url!r} cannot be used: {' '.join(str(exc).split())}") from None

    def get(self, key: str) -> bytes | None:
        try:
            data = self._client.get(key)
        except self._errors as exc:
            raise RemoteUnavailable(f"remote tier {self.url!r} failed on GET: {exc}") from None
        return None if data is None else bytes(data)

    def put(self, key: str, data: bytes) -> None:
        try:
            self._client.set(key, data)
        except self._errors as exc:
            raise RemoteUnavailable(f"remote tier {self.url!r} failed on SET: {exc}") from None

    def delete(self, key: str) -> None:
        try:
            self._client.delete(key)
        except self._errors as exc:
            raise RemoteUnavailable(f"remote tier {self.url!r} failed on DEL: {exc}") from None

    def close(self) -> None:
        self._client.close()
