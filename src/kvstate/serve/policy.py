"""Admission policy of the continuous-batching scheduler (pure): which waiting request joins the running batch next.

Continuous batching ("Orca: A Distributed Serving System for Transformer-Based Generative Models"; vLLM's
scheduler) admits requests into a running batch between decode steps. The scheduler asks a policy object
which waiting requests to admit, showing it each request's prompt length, its prefix-cache hit (the
tokens :meth:`SparsePrefixCache.lookup` says it would resume from) and its arrival order:

- ``fifo``: arrival order (vLLM's default);
- ``longest-prefix``: the request that would reuse the most cached tokens first, ties by arrival (SGLang's
  ``lpm`` policy: requests that share a prefix run while it is still stored).

Both respect the same bounds: at most ``max_batch`` requests run together (prefilling or decoding), and a
prefill runs in forward calls of at most ``max_tokens_per_step`` prompt tokens, one per step of the
running batch. A prefill that starts while other requests decode runs in calls of at most
``max_prefill_while_decoding`` tokens instead (Sarathi-Serve's stall-free budget: "Taming Throughput-Latency
Tradeoff in LLM Inference with Sarathi-Serve", Agrawal et al., OSDI 2024), so a long prompt delays the
others' next token by one such chunk's compute at most. :func:`plan_step` turns the bounds into each step's
plan (:class:`StepPlan`), which the runner executes. Ignores: priorities, preemption (a running request is
never swapped out), fairness between clients, several prefills in one step.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
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
    max_tokens_per_step: int = 512  # prompt tokens one step computes (one forward call) when nothing decodes
    # prompt tokens per step of a prefill that starts while requests decode; None: max_tokens_per_step
    max_prefill_while_decoding: int | None = None

    def __post_init__(self) -> None:
        if self.name not in POLICIES:
            raise KVStateError(f"policy {self.name!r} is not one of {sorted(POLICIES)}")
        for field, value, hi in (("max_batch", self.max_batch, 1024), ("max_tokens_per_step", self.max_tokens_per_step,
                                                                     1 << 20),
                                 ("max_prefill_while_decoding", self.max_prefill_while_decoding, 1 << 20)):
            if field == "max_prefill_while_decoding" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= hi:
                raise KVStateError(f"{field}={value!r} must be an int in 1..{hi}")

    def chunk(self, decoding: bool) -> int:
        """Prompt tokens per forward call of a prefill that starts now (``decoding``: other requests decode)."""
        if decoding and self.max_prefill_while_decoding is not None:
            return min(self.max_prefill_while_decoding, self.max_tokens_per_step)
        return self.max_tokens_per_step

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


@dataclass(frozen=True)
class StepPlan:
    """What one step runs, decided by the scheduler and executed by the runner: one decode forward over
    ``decode`` (one token per row), then one forward call of ``prefill``'s prompt (at most the chunk it
    started with). An empty plan: nothing to run."""

    decode: tuple[Hashable, ...] = ()
    prefill: Hashable | None = None

    @property
    def empty(self) -> bool:
        return not self.decode and self.prefill is None


def plan_step(decoding: Sequence[Hashable], prefilling: Sequence[Hashable]) -> StepPlan:
    """The next step: every decoding row, and the first prefill in line (prefills run one at a time, in the
    order they were admitted, so the first admitted request gets its first token first)."""
    return StepPlan(tuple(decoding), prefilling[0] if prefilling else None)
