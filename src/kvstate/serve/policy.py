"""Admission policy of the continuous-batching scheduler (pure): which waiting request joins the running batch next.

Continuous batching ("Orca: A Distributed Serving System for Transformer-Based Generative Models"; vLLM's
scheduler) admits requests into a running batch between decode steps. The scheduler asks a policy object
which waiting requests to admit, showing it each request's prompt length, its prefix-cache hit (the
tokens :meth:`SparsePrefixCache.lookup` says it would resume from) and its arrival order:

- ``fifo``: arrival order (vLLM's default);
- ``longest-prefix``: the request that would reuse the most cached tokens first, ties by arrival (SGLang's
  ``lpm`` policy: requests that share a prefix run while it is still stored).

Both respect the same bounds: at most ``max_batch`` requests decode together, and a prefill runs in
chunks of at most ``max_tokens_per_step`` tokens, with one decode step of the running batch between
chunks, so a long prompt delays the others' next token by one chunk's compute at most. Ignores:
priorities, preemption (a running request is never swapped out), fairness between clients.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvstate.errors import KVStateError


@dataclass(frozen=True)
class Waiting:
    """What a policy sees of a waiting request."""

    order: int  # arrival order (0 = first)
    prompt_tokens: int
    cached_tokens: int  # prompt tokens the prefix cache would restore (0 without a cache)


def _fifo(waiting: Sequence[Waiting]) -> list[Waiting]:
    return sorted(waiting, key=lambda w: w.order)


def _longest_prefix(waiting: Sequence[Waiting]) -> list[Waiting]:
    return sorted(waiting, key=lambda w: (-w.cached_tokens, w.order))


@dataclass(frozen=True)
class Admission:
    """A registered admission order: ``order(waiting)`` -> the waiting requests, first to admit first."""

    order: Callable[[Sequence[Waiting]], list[Waiting]]
    reads_cache: bool  # it reads Waiting.cached_tokens (the scheduler asks the prefix cache only then)


POLICIES: dict[str, Admission] = {
    "fifo": Admission(_fifo, reads_cache=False),
    "longest-prefix": Admission(_longest_prefix, reads_cache=True),
}


@dataclass(frozen=True)
class BatchPolicy:
    name: str = "fifo"  # a key of POLICIES
    max_batch: int = 8  # requests decoding together
    max_tokens_per_step: int = 512  # prompt tokens computed between two decode steps of the running batch

    def __post_init__(self) -> None:
        if self.name not in POLICIES:
            raise KVStateError(f"policy {self.name!r} is not one of {sorted(POLICIES)}")
        for field, value, hi in (("max_batch", self.max_batch, 1024), ("max_tokens_per_step", self.max_tokens_per_step,
                                                                     1 << 20)):
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= hi:
                raise KVStateError(f"{field}={value!r} must be an int in 1..{hi}")

    def admit(self, waiting: Sequence[Waiting], running: int) -> list[Waiting]:
        """The waiting requests to admit now, in the order to prefill them (none when the batch is full)."""
        room = self.max_batch - running
        if room <= 0:
            return []
        return POLICIES[self.name].order(waiting)[:room]

    @property
    def reads_cache(self) -> bool:
        """Whether admission reads how many prompt tokens the prefix cache would restore."""
        return POLICIES[self.name].reads_cache
