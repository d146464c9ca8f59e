"""Continuous batching: a bounded queue in front of one worker thread that schedules and runs a batch.

Continuous batching as in Orca ("Orca: A Distributed Serving System for Transformer-Based Generative
Models", OSDI 2022) and vLLM's scheduler, over a hybrid model with the sparse prefix cache under it:
requests wait in a queue of at most ``max_queue`` beyond the batch's free rows (one more is refused at
once, :class:`QueueFull`, answered 503). Each step the worker asks the policy
(:class:`~kvstate.serve.policy.BatchPolicy`: FIFO or longest-prefix-hit first, ``max_batch``) which waiting
requests to admit, showing it each prompt and its prefix-cache hit (one explicit question,
:meth:`Generator.cached_tokens`), plans the step (:func:`~kvstate.serve.policy.plan_step`: every decoding row,
and one forward call of the first prefill in line) and hands the plan to the runner
(:class:`~kvstate.serve.runner.Runner`), which executes it and owns the model's state: the scheduler decides,
the runner executes, nothing calls back. An admitted request is prefilled through the prefix cache (resume
from its checkpoint + KV, compute the rest) in calls of at most ``max_tokens_per_step`` tokens, or of
``max_prefill_while_decoding`` when it starts while others decode, so a long prompt delays the others by one
chunk at a time; then it joins the :class:`~kvstate.serve.batching.DecodeBatch` (attention KV left-padded
with per-row positions and masks, recurrent and conv states stacked per row). Every step decodes one token
per row in one forward call; a row whose reply ended, or whose client went away, leaves the batch before the
next step, and a finished reply goes into the prefix cache; a request whose client goes away mid-prefill is
aborted inside the prefix cache (the store as if it never came). One thread drives the model, so the prefix
store has one writer; what a prefill resumes from stays pinned until that prefill ends.

Events on :attr:`Job.events`: ``("delta", Delta)``, then one of ``("done", Generation)``, ``("error",
exception)``, ``("cancelled", None)``, ``("aborted", Generation)``. A failed prefill fails its own request; a
failed decode step fails the requests in the batch then, and the worker keeps serving.

Shutdown with a deadline (:meth:`Scheduler.close`): no request is admitted any more (:class:`ShuttingDown`);
those queued or running go on for the grace period, then the worker ends the rest: a running reply with
``finish_reason`` ``"abort"`` (vLLM's name; event ``aborted``, its partial text already sent), a queued one
with :class:`ShuttingDown`. Ignores: preemption (a running request is never swapped out), priorities.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

from kvstate.errors import KVStateError
from kvstate.serve.batching import BatchBytes, DecodeBatch
from kvstate.serve.generation import Decoding, Generation, GenerationRequest, Generator, Prefilled
from kvstate.serve.policy import BatchPolicy, StepPlan, Waiting, plan_step
from kvstate.serve.runner import Runner

IDLE_WAIT_S = 0.05  # how long an idle worker sleeps before looking at the queue again (a submit wakes it)


class QueueFull(KVStateError):
    """Every queue slot is taken; the client should retry later."""


class ShuttingDown(KVStateError):
    """The server is shutting down: it admits no request, and ends those still running at its deadline."""


ABORT = "abort"  # the finish_reason of a reply the shutdown deadline ended


class Job:
    """One request on its way through the worker; created on the event loop, run on the worker thread."""

    def __init__(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop, order: int) -> None:
        self.request = request
        self.order = order
        self.events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self._loop = loop
        self._cancel = threading.Event()
        self.finished = threading.Event()  # set by the worker when the job is over, whatever the outcome

    def cancel(self) -> None:
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def post(self, kind: str, payload: Any = None) -> None:
        with contextlib.suppress(RuntimeError):  # the event loop closed: the server is shutting down
            self._loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))


class Scheduler:
    """``submit`` requests from the event loop; one daemon thread admits, prefills and decodes them in a batch."""

    def __init__(self, max_queue: int, generator: Generator | None = None, policy: BatchPolicy | None = None,
                 on_job_end: Callable[[str], None] | None = None,
                 on_generation: Callable[[Generation], None] | None = None) -> None:
        self.max_queue = max_queue
        self.gen = generator
        self.policy = policy or BatchPolicy()
        self._on_job_end = on_job_end or (lambda outcome: None)
        self._on_generation = on_generation or (lambda g: None)
        self._waiting: list[Job] = []
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._order = itertools.count()
        self._deadline: float | None = None  # set by close(): the monotonic time the running requests end at
        self._grace = 0.0
        self._rows: dict[int, tuple[Job, Decoding]] = {}  # the decode batch's requests, by job order
        self._prefilling: dict[int, tuple[Job, Decoding]] = {}  # requests the runner is prefilling, by job order
        self._runner = None if generator is None else Runner(generator, self.policy.max_batch)
        self.running = 0  # requests being generated now (prefilling or in the batch)
        self.steps = 0  # decode steps run (each one forward call over the batch)
        self.prefill_calls = 0  # prefill forward calls run by steps (each at most its request's chunk)

    @property
    def depth(self) -> int:
        """Requests waiting (the running ones not counted)."""
        with self._cond:
            return len(self._waiting)

    @property
    def batch_bytes(self) -> BatchBytes:
        """Bytes the running decode batch holds for its requests, as measured after its last change (a request
        being prefilled is not in it yet)."""
        return BatchBytes() if self._runner is None else self._runner.held

    @property
    def batch_peak_bytes(self) -> int:
        return 0 if self._runner is None else self._runner.batch.peak_bytes

    @property
    def _batch(self) -> DecodeBatch | None:
        """The runner's decode batch (tests and ``/metrics`` read it)."""
        return None if self._runner is None else self._runner.batch

    @property
    def closing(self) -> bool:
        """:meth:`close` was called: no request is admitted any more."""
        return self._deadline is not None

    @property
    def idle(self) -> bool:
        """No request waits or runs."""
        with self._cond:
            return not self._waiting and self.running == 0

    def close(self, grace: float) -> None:
        """Admit no more requests; those queued or running may finish for ``grace`` seconds, then the worker ends
        them (a running reply with finish_reason ``"abort"``, a queued request with :class:`ShuttingDown`)."""
        with self._cond:
            if self._deadline is None:
                self._grace, self._deadline = grace, time.monotonic() + grace
            self._cond.notify_all()

    def _overdue(self) -> bool:
        return self._deadline is not None and time.monotonic() >= self._deadline

    def _gone(self) -> ShuttingDown:
        return ShuttingDown(f"the server is shutting down and its shutdown grace ({self._grace:g} s) ran out before "
                            "this request ran; retry against a running server")

    def start(self) -> None:
        if self.gen is None:
            raise KVStateError("Scheduler.start: no generator to run requests on; pass generator=")
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="kvstate-serve-worker", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        gone = ShuttingDown("the server is shutting down; retry against a running server")
        with self._cond:
            waiting, self._waiting = self._waiting, []
        if self._runner is not None:
            self._runner.close()
        for job in waiting + [j for j, _ in self._rows.values()] + [j for j, _ in self._prefilling.values()]:
            job.post("error", gone)
            job.finished.set()
        self._rows.clear()
        self._prefilling.clear()

    def _room(self) -> int:
        """Requests that may still wait: ``max_queue`` beyond the batch's free rows. A request the batch can
        take at its next step is not refused: a client that just got its reply and sends the next one at once
        finds its own row free, not a full queue (call with the lock held)."""
        free = max(0, self.policy.max_batch - self.running)
        return self.max_queue + free - len(self._waiting)

    def check_room(self, pending: int = 0) -> None:
        """:class:`QueueFull` when ``max_queue`` requests already wait beyond the batch's free rows, ``pending``
        requests not yet submitted (being checked) counted among them (a request can be refused before it is
        checked)."""
        with self._cond:
            if self._deadline is not None:
                raise self._closed()
            if self._room() - pending <= 0:
                raise self._full()

    def submit(self, request: GenerationRequest) -> Job:
        """Queue ``request``; raises :class:`QueueFull` when ``max_queue`` requests already wait, :class:`ShuttingDown`
        after :meth:`close`."""
        job = Job(request, asyncio.get_running_loop(), next(self._order))
        with self._cond:
            if self._deadline is not None:
                raise self._closed()
            if self._room() <= 0:
                raise self._full()
            self._waiting.append(job)
            self._cond.notify()
        return job

    def _full(self) -> QueueFull:
        return QueueFull(f"the server is busy: {self.max_queue} requests already wait (--max-queue {self.max_queue}); "
                         "retry later")

    @staticmethod
    def _closed() -> ShuttingDown:
        return ShuttingDown("the server is shutting down and admits no new request; retry against a running server")

    # -- the worker ---------------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            if self._overdue():
                self._end_overdue()
            for job in self._admit():
                self._start(job)
            self._drop_cancelled()
            plan = plan_step(tuple(self._rows), self._runner.prefilling if self._runner is not None else ())
            if not plan.empty:
                self._execute(plan)
            else:
                with self._cond:
                    if not self._waiting and not self._stop.is_set():
                        self._cond.wait(IDLE_WAIT_S)

    def _end_overdue(self) -> None:
        """Past the shutdown deadline: the queued requests fail, a prefill in progress ends with finish_reason
        ``"abort"`` (its transaction aborted), the running replies end with ``"abort"`` (nothing of them goes
        into the prefix cache)."""
        assert self._runner is not None
        with self._cond:
            waiting, self._waiting = self._waiting, []
        for job in waiting:
            self._end(job, "error", self._gone(), outcome="shutdown")
        for order in self._runner.prefilling:
            job, d = self._prefilling.pop(order)
            self._runner.cancel_prefill(order)
            d.finish = ABORT
            self._done(job, d, None)
        for rid, (_, d) in list(self._rows.items()):
            d.finish = ABORT
            self._leave(rid, keep_cache=False)

    def _admit(self) -> list[Job]:
        """The waiting requests the policy admits now (taken off the queue), in prefill order. Requests being
        prefilled count against ``max_batch`` like the decoding ones."""
        with self._cond:
            if not self._waiting:
                return []
            waiting = list(self._waiting)
        running = len(self._rows) + len(self._prefilling)
        if running >= self.policy.max_batch:
            return []
        seen = [Waiting(j.order, len(j.request.prompt_ids), self._cached(j)) for j in waiting]
        by_order = {j.order: j for j in waiting}
        picked = [by_order[w.order] for w in self.policy.admit(seen, running)]
        chosen = {j.order for j in picked}
        with self._cond:  # waiting → running in one step: the queue's room never counts a request twice
            self._waiting = [j for j in self._waiting if j.order not in chosen]
            self.running += len(picked)
        return picked

    def _cached(self, job: Job) -> int:
        """Prompt tokens the prefix cache would restore for ``job`` (only a policy that reads the cache asks)."""
        if not self.policy.reads_cache or self.gen is None:
            return 0
        return self.gen.cached_tokens(job.request.prompt_ids)

    def _start(self, job: Job) -> None:
        """Hand ``job``'s prefill to the runner, in chunks the policy sizes by whether requests decode now."""
        assert self.gen is not None and self._runner is not None
        if job.cancelled or self._overdue():
            self.running -= 1
            if job.cancelled:
                self._end(job, "cancelled", None)
            else:
                self._end(job, "error", self._gone(), outcome="shutdown")
            return
        try:
            d = self.gen.begin(job.request, lambda delta: job.post("delta", delta), lambda: job.cancelled)
            self._runner.start_prefill(job.order, d, self.policy.chunk(decoding=bool(self._rows)))
        except Exception as exc:  # this request fails; the worker keeps serving the others
            self.running -= 1
            self._end(job, "error", exc)
            return
        self._prefilling[job.order] = (job, d)

    def _drop_cancelled(self) -> None:
        """Requests whose client went away leave before the next step: no forward pass runs for them; a
        prefill in progress is aborted inside the prefix cache (the store is as if it never came)."""
        assert self._runner is not None
        for order, (job, _) in list(self._prefilling.items()):
            if job.cancelled:
                del self._prefilling[order]
                self._runner.cancel_prefill(order)
                self.running -= 1
                self._end(job, "cancelled", None)
        for rid, (job, d) in list(self._rows.items()):
            if job.cancelled:
                d.finish = "cancelled"
                self._leave(rid, keep_cache=False)

    def _execute(self, plan: StepPlan) -> None:
        """Have the runner execute ``plan``, then sample each decoded row's token and move a finished prefill
        into the batch."""
        assert self._runner is not None
        res = self._runner.execute(plan, {rid: d.next_token for rid, (_, d) in self._rows.items()})
        if res.decode_error is not None:  # the batch's state is unusable: fail its requests, keep serving
            for rid in plan.decode:
                job, _ = self._rows.pop(rid)
                self._runner.leave(rid, keep_cache=False)
                self.running -= 1
                self._end(job, "error", res.decode_error)
        elif res.logits is not None:
            self.steps += 1
            for rid in plan.decode:
                _, d = self._rows[rid]
                d.covered += 1
                if not d.take(res.logits[rid]):
                    self._leave(rid, keep_cache=d.finish != "cancelled")
        if plan.prefill is not None:
            self.prefill_calls += res.prefill_calls
            if res.prefill_error is not None:
                job, _ = self._prefilling.pop(plan.prefill)
                self.running -= 1
                self._end(job, "error", res.prefill_error)
            elif res.prefilled is not None:
                self._joined(plan.prefill, res.prefilled)

    def _joined(self, order: int, p: Prefilled) -> None:
        """A prefill ended: its first token; the request joins the decode batch unless its reply is over."""
        assert self._runner is not None
        job, d = self._prefilling.pop(order)
        try:
            if not d.take(p.logits):
                self._done(job, d, p.cache)
                return
            self._runner.join(order, p.cache, d.covered)
        except Exception as exc:
            self.running -= 1
            self._end(job, "error", exc)
            return
        self._rows[order] = (job, d)

    def _leave(self, rid: int, keep_cache: bool) -> None:
        assert self._runner is not None
        job, d = self._rows.pop(rid)
        keep = keep_cache and self.gen is not None and self.gen.cache is not None
        self._done(job, d, self._runner.leave(rid, keep_cache=keep))

    def _done(self, job: Job, d: Decoding, cache: Any) -> None:
        assert self.gen is not None
        self.running -= 1
        try:
            g = self.gen.finish(d, cache)
        except Exception as exc:
            self._end(job, "error", exc)
            return
        self._on_generation(g)
        if g.finish_reason == "cancelled":
            self._end(job, "cancelled", None)
        elif g.finish_reason == ABORT:
            self._end(job, "aborted", g, outcome="shutdown")
        else:
            self._end(job, "done", g)

    def _end(self, job: Job, kind: str, payload: Any, outcome: str | None = None) -> None:
        job.post(kind, payload)
        job.finished.set()
        self._on_job_end(outcome or {"done": "ok", "cancelled": "cancelled"}.get(kind, "error"))
