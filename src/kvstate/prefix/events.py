"""Cache events for a cache-aware router: what a replica's prefix cache stored and evicted, by content hash.

A router that sends each request to the replica holding the longest prefix of it (SGLang's cache-aware
router, vLLM's KV-cache events: ``BlockStored`` / ``BlockRemoved`` with block hashes) needs to know what
each replica holds. For sparse prefix caching ("Sparse Prefix Caching for Hybrid and Recurrent LLM
Serving") that is two things, and the second is what existing event streams leave out: the attention KV
of the prefix (reported per block of ``align`` tokens, by the hash chain of :mod:`kvstate.prefix.hashing`)
and the recurrent checkpoints — a request resumes only from a position where a recurrent state is stored,
so a router scoring replicas by KV blocks alone over-rates a hybrid replica whose checkpoints were evicted.

:class:`CacheEvents` is the store's observer (:class:`~kvstate.prefix.store.PrefixStore`'s ``observer``):
each change becomes one :class:`CacheEvent` with a sequence number in a bounded log; a reader polls
``since(seq)`` and learns how many events it missed if it fell behind. Thread-safe. Ignores: blocks that
are never complete (a KV span shorter than a block is reported with the checkpoint or block that ends
it), and persistence (a restarted replica starts a new log; ``epoch`` tells readers).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

from kvstate.prefix import hashing


@dataclass(frozen=True)
class CacheEvent:
    seq: int  # 1, 2, ... in the order the store changed
    time: float  # unix seconds
    type: str  # "stored" or "evicted"
    kind: str  # "kv" (attention KV blocks) or "checkpoint" (a recurrent state)
    block_hashes: tuple[str, ...]  # kv: the complete blocks the change adds or breaks; checkpoint: ()
    parent_hash: str  # kv: the hash of the prefix before the first block; checkpoint: of its blocks before it
    position: int  # kv: tokens the span ends at; checkpoint: the state's position (tokens it covers)
    prefix_hash: str  # checkpoint: the hash of the first `position` tokens (kvstate.prefix.hashing.state_hash); kv: ""

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "block_hashes": list(self.block_hashes)}


class CacheEvents:
    """A bounded log of one prefix cache's store / evict events (the store's observer)."""

    def __init__(self, fingerprint: str, align: int, capacity: int = 4096) -> None:
        self.fingerprint = fingerprint
        self.align = int(align)
        self.epoch = uuid.uuid4().hex[:12]  # a new log after a restart: readers start over
        self._log: deque[CacheEvent] = deque(maxlen=int(capacity))
        self._seq = 0
        self._lock = threading.Lock()

    def __call__(self, event: str, kind: str, tokens: tuple[int, ...], start: int) -> None:
        a = self.align
        hashes = hashing.chain(self.fingerprint, tokens, a)
        n = len(tokens)
        if kind == "kv":
            first = start // a + 1  # blocks whose last token lies in (start, n]
            blocks = tuple(hashes[k].hex()[:32] for k in range(first, n // a + 1))
            if not blocks:
                return
            made = ("kv", blocks, hashes[first - 1].hex()[:32], n, "")
        else:
            made = ("checkpoint", (), hashes[n // a].hex()[:32], n, hashing.state_hash(hashes, tokens, n, a)[:32])
        with self._lock:
            self._seq += 1
            self._log.append(CacheEvent(self._seq, time.time(), event, *made))

    @property
    def head(self) -> int:
        """The sequence number of the newest event (0 before any): a cursor past it is not from this log."""
        with self._lock:
            return self._seq

    def since(self, seq: int = 0, limit: int = 1000) -> tuple[list[CacheEvent], int, int]:
        """Events after ``seq`` (at most ``limit``), the sequence number to ask from next, and how many
        events after ``seq`` the log no longer holds (the reader fell behind: resync)."""
        with self._lock:
            events = [e for e in self._log if e.seq > seq][:limit]
            oldest = self._log[0].seq if self._log else self._seq + 1  # the first event the log still holds
            dropped = max(0, oldest - seq - 1)
            nxt = events[-1].seq if events else max(seq, self._seq)
        return events, nxt, dropped
