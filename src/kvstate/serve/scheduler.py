"""A bounded request queue in front of one worker thread that owns the model.

One model serves one request at a time (the prefix cache serves a batch of one), so requests wait in a
FIFO of at most ``max_queue``; one more is refused at once (:class:`QueueFull`, answered 503) rather
than left hanging. The worker runs each job's function with two callbacks: ``emit`` (a text delta,
handed to the job's asyncio queue on the server's event loop) and ``cancelled`` (set when the client
went away: the job stops at its next token; a job cancelled while it waits is skipped). Events on
:attr:`Job.events`: ``("delta", str)``, then one of ``("done", result)``, ``("error", exception)``,
``("cancelled", None)``.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Any

from kvstate.errors import KVStateError

Work = Callable[[Callable[[str], None], Callable[[], bool]], Any]


class QueueFull(KVStateError):
    """Every queue slot is taken; the client should retry later."""


class Job:
    """One request on its way through the worker; created on the event loop, run on the worker thread."""

    def __init__(self, work: Work, loop: asyncio.AbstractEventLoop) -> None:
        self.work = work
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
    """``submit`` jobs from the event loop; one daemon thread runs them in order."""

    def __init__(self, max_queue: int, on_job_end: Callable[[str], None] | None = None) -> None:
        self.max_queue = max_queue
        self._queue: queue.Queue[Job] = queue.Queue(maxsize=max_queue)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._on_job_end = on_job_end or (lambda outcome: None)
        self.running = 0  # jobs being run now (0 or 1)

    @property
    def depth(self) -> int:
        """Jobs waiting (the running one not counted)."""
        return self._queue.qsize()

    def start(self) -> None:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="kvstate-serve-worker", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        while True:  # whatever still waits is told the server is going away
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            job.post("error", KVStateError("the server is shutting down; retry against a running server"))
            job.finished.set()

    def check_room(self) -> None:
        """:class:`QueueFull` when ``max_queue`` jobs already wait (a request can be refused before it is checked)."""
        if self._queue.full():
            raise self._full()

    def submit(self, work: Work) -> Job:
        """Queue ``work``; raises :class:`QueueFull` when ``max_queue`` jobs already wait."""
        job = Job(work, asyncio.get_running_loop())
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise self._full() from None
        return job

    def _full(self) -> QueueFull:
        return QueueFull(f"the server is busy: {self.max_queue} requests already wait (--max-queue {self.max_queue}); "
                         "retry later")

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                job = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            self._run(job)

    def _run(self, job: Job) -> None:
        if job.cancelled:
            job.post("cancelled")
            job.finished.set()
            self._on_job_end("cancelled")
            return
        self.running = 1
        outcome = "error"
        try:
            result = job.work(lambda text: job.post("delta", text), lambda: job.cancelled)
            outcome = "cancelled" if getattr(result, "finish_reason", "") == "cancelled" else "ok"
            job.post("done", result)
        except Exception as exc:  # reported to the client as a 500; the worker keeps serving
            job.post("error", exc)
        finally:
            self.running = 0
            job.finished.set()
            self._on_job_end(outcome)
