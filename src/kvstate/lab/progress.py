"""One progress convention for the lab: a bar on stderr, never on stdout.

Every long loop (evaluation, benchmarks, training, calibration, replay) reports through
:func:`progress_bar`, so ``--json`` output on stdout stays one JSON document whatever runs. On a terminal
the bar is a transient rich ``Progress`` on ``Console(stderr=True)`` (it vanishes when done, leaving the
table); when stderr is a file or a pipe (a log, a CI job) it becomes a plain line at most every
``interval`` seconds and one at the end, so logs show progress without control codes. ``enabled=False``
shows nothing. Ignored: nested bars (each loop owns one) and ETA smoothing beyond rich's own.
"""

from __future__ import annotations

import sys
import time
from typing import Any


class Bar:
    """What a loop calls: ``advance`` by done units, ``set`` the done count, ``note`` a short status, ``close``.

    A context manager too: ``with progress_bar(...) as bar:`` closes it however the block ends.
    """

    def __init__(self, total: float | None) -> None:
        self.total = total  # units to do (None: unknown)
        self.done = 0.0  # units done so far
        self.text = ""  # the latest note, shown after the count

    def advance(self, k: float = 1) -> None:
        self.set(self.done + k)

    def set(self, done: float) -> None:
        self.done = done
        self._show()

    def note(self, text: str) -> None:
        self.text = text
        self._show()

    def close(self) -> None:
        pass

    def __enter__(self) -> Bar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _show(self) -> None:
        pass


class _RichBar(Bar):
    def __init__(self, total: float | None, progress: Any, task: Any) -> None:
        super().__init__(total)
        self._progress, self._task = progress, task

    def _show(self) -> None:
        self._progress.update(self._task, completed=self.done, note=self.text)

    def close(self) -> None:
        self._progress.stop()


class _LineBar(Bar):
    def __init__(self, total: float | None, description: str, unit: str, interval: float) -> None:
        super().__init__(total)
        self._description, self._unit, self._interval = description, unit, interval
        self._t0 = self._last = time.monotonic()
        self._closed = False

    def line(self) -> None:
        of = f"/{self.total:g}" if self.total is not None else ""
        note = f"  {self.text}" if self.text else ""
        sys.stderr.write(f"{self._description}: {self.done:g}{of} {self._unit} "
                         f"({time.monotonic() - self._t0:.0f} s){note}\n")
        sys.stderr.flush()

    def _show(self) -> None:
        if time.monotonic() - self._last >= self._interval:
            self._last = time.monotonic()
            self.line()

    def close(self) -> None:
        if not self._closed:  # the final count, also for a run shorter than one interval
            self._closed = True
            self.line()


def progress_bar(description: str, total: float | None = None, *, enabled: bool = True, unit: str = "items",
                 interval: float = 30.0) -> Bar:
    """Start a progress bar on stderr for one loop: ``with progress_bar("eval", total=n) as bar: bar.advance()``."""
    if not enabled:
        return Bar(total)
    from rich.console import Console

    console = Console(stderr=True)
    if not console.is_terminal:
        return _LineBar(total, description, unit, interval)
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn(unit),
               TimeElapsedColumn(), TimeRemainingColumn(), TextColumn("{task.fields[note]}"))
    progress = Progress(*columns, console=console, transient=True)
    progress.start()
    return _RichBar(total, progress, progress.add_task(description, total=total, note=""))
