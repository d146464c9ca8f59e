"""A long lab job run as a child that stops when its parent is told to stop.

``kvstate lab reproduce`` and ``kvstate lab retrain`` run each job as a shell command that may start
processes of its own (a Python run, a kvpress runner, a network namespace). :func:`run_job` starts the
command in its own process group (its own session), so a SIGINT or SIGTERM sent to the parent alone
reaches every process of the job: the parent forwards the signal to the child's group, waits up to
``grace_s`` for the group to end (a journaled job finishes the line it is writing), then kills what is
left with SIGKILL and raises :class:`KeyboardInterrupt` (the CLI exits with 130). Nothing of the job
outlives the parent's interruption. Ignored: a job process that moves itself to another process group
or session.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

GRACE_S = 10.0  # how long a signalled job may take to stop before it is killed


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a member we may not signal still exists
        return True
    return True


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # the group has already ended
        os.killpg(pgid, sig)


def run_job(command: str, *, cwd: str | Path, env: Mapping[str, str] | None = None, stdout: IO[Any] | None = None,
            stderr: IO[Any] | int | None = None, grace_s: float = GRACE_S) -> int:
    """Run the shell ``command`` in its own process group and return its exit status.

    On SIGINT / SIGTERM to this process while the job runs: the signal is forwarded to the job's group,
    the group gets ``grace_s`` seconds to end, then SIGKILL; then :class:`KeyboardInterrupt` is raised.
    """
    child = subprocess.Popen(command, shell=True, cwd=cwd, env=dict(env) if env is not None else None,
                             stdout=stdout, stderr=stderr, start_new_session=True)
    received: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        received.append(signum)
        _signal_group(child.pid, signum)

    installed = threading.current_thread() is threading.main_thread()  # signal handlers live in the main thread
    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)} if installed else {}
    try:
        while not received:
            try:
                code = child.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                continue
            if not received:
                return code
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and (child.poll() is None or _group_alive(child.pid)):
            time.sleep(0.05)
        _signal_group(child.pid, signal.SIGKILL)
        child.wait()
        raise KeyboardInterrupt(f"stopped by signal {signal.Signals(received[0]).name}; the job was stopped too")
    except BaseException:
        if child.poll() is None:  # an error of our own while the job runs: it never outlives us
            _signal_group(child.pid, signal.SIGKILL)
            child.wait()
        raise
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


__all__ = ["run_job"]
