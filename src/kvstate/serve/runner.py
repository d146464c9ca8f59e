"""The runner: executes the scheduler's plan for one step — a decode forward over the batch, one prefill call.

vLLM v1 splits its engine the same way: the scheduler decides, each step, which requests run and how many of
their tokens; the model runner executes that plan and reports back ("vLLM V1: A Major Upgrade to vLLM's Core
Architecture", vLLM blog, 2025). Here the scheduler (:mod:`kvstate.serve.scheduler`) owns the queue, the
admission policy and the requests' sampling; it hands the runner a :class:`~kvstate.serve.policy.StepPlan`,
and the runner owns the model's state: the :class:`~kvstate.serve.batching.DecodeBatch` of the requests that
decode and the :class:`PrefillTask` of each request being prefilled. Nothing the runner executes calls back
into the scheduler.

A :class:`PrefillTask` is one request's prefill through the prefix cache (:meth:`Generator.prefill`: resume
from its checkpoint + KV, compute the rest in forward calls of at most ``chunk`` tokens), run one forward
call per :meth:`PrefillTask.advance`. The prefill keeps its own Python stack between calls (a helper thread
that runs only while the worker waits on it, never beside it, so the model is still driven by one thread at a
time); :meth:`PrefillTask.cancel` ends it inside the prefix cache's transaction, which aborts it: the store
is as if the request never came. A step's decode forward and prefill call are two forward calls: one forward
mixing prompt chunks and decode rows needs ragged (varlen) attention and recurrent kernels that
transformers' model classes do not have.

Ignores: several prefills in one step, preemption, CUDA streams (the helper thread runs on the worker's
device, synchronously).
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from kvstate.errors import KVStateError
from kvstate.serve.batching import BatchBytes, BatchConfig, DecodeBatch
from kvstate.serve.generation import Decoding, Generator, Prefilled
from kvstate.serve.policy import StepPlan


class PrefillCancelled(KVStateError):
    """Raised inside a cancelled prefill so the prefix cache aborts its transaction; never reaches a client."""


class PrefillTask:
    """One request's chunked prefill, advanced one forward call at a time by the runner (see the module)."""

    def __init__(self, gen: Generator, d: Decoding, chunk: int) -> None:
        self.d = d
        self.chunk = chunk
        self.calls = 0  # forward calls run so far
        self.result: Prefilled | None = None
        self.error: BaseException | None = None
        self._gen = gen
        self._go = threading.Semaphore(0)  # the worker lets the prefill run one more call
        self._parked = threading.Semaphore(0)  # the prefill gave control back (after a call, or at its end)
        self._cancel = False
        self._done = False
        self._thread: threading.Thread | None = None

    @property
    def done(self) -> bool:
        return self._done

    def _between(self) -> None:  # runs on the helper thread after every forward call but the last
        self.calls += 1
        self._parked.release()
        self._go.acquire()
        if self._cancel:
            raise PrefillCancelled("prefill cancelled")

    def _run(self) -> None:
        self._go.acquire()
        try:
            if not self._cancel:
                self.result = self._gen.prefill(self.d, chunk=self.chunk, between=self._between)
                self.calls += 1
        except BaseException as exc:  # handed to the worker by advance()
            self.error = exc
        finally:
            self._done = True
            self._parked.release()

    def advance(self) -> bool:
        """Run the prefill's next forward call (on the calling thread's behalf); True once it has ended.
        Raises what the prefill raised."""
        if self._done:
            raise KVStateError("PrefillTask.advance: this prefill has already ended")
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvstate-serve-prefill", daemon=True)
            self._thread.start()
        self._go.release()
        self._parked.acquire()
        if self.error is not None:
            raise self.error
        return self._done

    def cancel(self) -> None:
        """End the prefill where it stands; the prefix cache aborts it (nothing it restored stays pinned)."""
        if self._done:
            return
        self._cancel = True
        if self._thread is None:  # never ran
            self._done = True
            return
        self._go.release()
        self._parked.acquire()
        self._thread.join()


@dataclass
class StepResult:
    """What one executed step produced."""

    logits: Mapping[Hashable, torch.Tensor] | None = None  # each decoded row's next-token logits (V,)
    decode_error: BaseException | None = None  # the decode forward failed: every row in it is lost
    prefilled: Prefilled | None = None  # the planned prefill ended this step
    prefill_error: BaseException | None = None  # the planned prefill failed (that request only)
    prefill_calls: int = 0  # prefill forward calls this step ran (0 or 1)
    decoded: tuple[Hashable, ...] = field(default=())


class Runner:
    """Owns the decode batch and the prefills in progress; :meth:`execute` runs one :class:`StepPlan`."""

    def __init__(self, gen: Generator, max_batch: int) -> None:
        self.gen = gen
        self.batch = DecodeBatch(gen.model, BatchConfig(max_batch))
        self._prefills: dict[Hashable, PrefillTask] = {}

    # -- requests entering and leaving ------------------------------------------------------------
    def start_prefill(self, key: Hashable, d: Decoding, chunk: int) -> None:
        if key in self._prefills or key in self.batch:
            raise KVStateError(f"Runner.start_prefill: request {key!r} is already running")
        self._prefills[key] = PrefillTask(self.gen, d, chunk)

    def cancel_prefill(self, key: Hashable) -> None:
        task = self._prefills.pop(key, None)
        if task is not None:
            task.cancel()

    def prefill_chunk(self, key: Hashable) -> int:
        return self._prefills[key].chunk

    def join(self, key: Hashable, cache: Any, covered: int) -> None:
        """A prefilled request joins the decode batch."""
        self.batch.add(key, cache, covered)

    def leave(self, key: Hashable, keep_cache: bool) -> Any:
        """A request leaves the decode batch; its cache (prompt + reply) when ``keep_cache``."""
        cache = self.batch.cache_of(key) if keep_cache else None
        self.batch.remove(key)
        return cache

    @property
    def prefilling(self) -> tuple[Hashable, ...]:
        return tuple(self._prefills)

    @property
    def held(self) -> BatchBytes:
        return self.batch.held

    # -- one step ---------------------------------------------------------------------------------
    def execute(self, plan: StepPlan, next_tokens: Mapping[Hashable, int]) -> StepResult:
        """Run ``plan``: one decode forward over ``plan.decode`` (each row fed ``next_tokens[row]``), then one
        forward call of ``plan.prefill``'s prompt."""
        res = StepResult()
        if plan.decode:
            try:  # the batch refuses a plan that does not name every row once (a recurrent state cannot skip)
                res.logits = self.batch.step({k: next_tokens[k] for k in plan.decode})
                res.decoded = plan.decode
            except Exception as exc:  # the batch's state is unusable: the scheduler fails its requests
                res.decode_error = exc
        if plan.prefill is not None:
            task = self._prefills[plan.prefill]
            res.prefill_calls = 1
            try:
                if task.advance():
                    res.prefilled = task.result
                    del self._prefills[plan.prefill]
            except Exception as exc:
                del self._prefills[plan.prefill]
                res.prefill_error = exc
        return res

    def close(self) -> None:
        """Cancel every prefill in progress (their prefix-cache transactions abort)."""
        for key in list(self._prefills):
            self.cancel_prefill(key)
