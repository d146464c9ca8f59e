"""kvpress presses item by item: one long-lived runner in kvpress's own environment, for the item-major loop.

The batch adapter (:mod:`kvstate.lab.semantic.baselines_kvpress`) runs a press over every item in one subprocess
call; the lab's item-major loop (:func:`kvstate.lab.experiment.run_items`) measures every method on one item
before the next, so a press must answer one item at a time. :class:`PressWorker` starts
``kvpress_runner.py --serve`` once with the kvpress environment's interpreter (the model loads once), sends one
request per item and reads one reply: the runner's rows (prediction, bytes held and read, the compressed
context's bytes; masked keys of a masking press not counted). The press never enters this process (kvpress
patches transformers' attention when imported). A runner that dies or answers nonsense is one
:class:`~kvstate.lab.semantic.baselines_kvpress.KVPressEnvError` naming its last stderr lines.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from kvstate.lab.semantic.baselines_kvpress import RUNNER, KVPressEnvError

SUFFIX = "Press"


def is_press(name: str) -> bool:
    """Whether a method name is a kvpress class name (``KVzipPress``)."""
    return name.endswith(SUFFIX) and name.isidentifier()


class PressWorker:
    """``with PressWorker(python, model_dir) as w: rows = w.run(item, presses, budgets)``."""

    def __init__(self, python: Path, model_dir: Path, threads: int = 1) -> None:
        self.python, self.model_dir, self.threads = Path(python), Path(model_dir), threads
        self._proc: subprocess.Popen[str] | None = None
        self._err: IO[str] | None = None
        self.versions: dict[str, str] = {}

    def _tail(self) -> str:
        if self._err is None:
            return ""
        self._err.flush()
        self._err.seek(0)
        return self._err.read()[-800:].strip()

    def _fail(self, what: str) -> KVPressEnvError:
        return KVPressEnvError(f"the kvpress runner ({self.python}) {what}: {self._tail() or 'no stderr'}")

    def _readline(self) -> dict[str, Any]:
        assert self._proc is not None and self._proc.stdout is not None
        line = self._proc.stdout.readline()
        if not line:
            raise self._fail(f"exited with code {self._proc.wait()}")
        try:
            got = json.loads(line)
        except json.JSONDecodeError as exc:
            raise self._fail(f"answered {line[:200]!r}") from exc
        if not isinstance(got, dict):
            raise self._fail(f"answered {line[:200]!r}")
        return got

    def start(self) -> PressWorker:
        if self._proc is None:
            self._err = tempfile.TemporaryFile("w+")  # noqa: SIM115 (lives as long as the runner; close() closes it)
            self._proc = subprocess.Popen(
                [str(self.python), str(RUNNER), "--model", str(self.model_dir), "--serve", "--threads",
                 str(self.threads)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, text=True)
            ready = self._readline()
            if not ready.get("ready"):
                raise self._fail(f"did not start ({ready})")
            self.versions = {k: str(v) for k, v in ready.items() if k != "ready"}
        return self

    def run(self, item: Any, presses: Sequence[str], budgets: Sequence[float]) -> list[dict[str, Any]]:
        """The runner's rows for ``presses`` at ``compression_ratio = 1 - budget`` on one item (an
        :class:`~kvstate.lab.semantic.protocol.Item` or its row)."""
        from dataclasses import asdict, is_dataclass

        self.start()
        assert self._proc is not None and self._proc.stdin is not None
        row = asdict(item) if is_dataclass(item) else dict(item)
        req = {"item": row, "presses": list(presses), "ratios": [round(1 - b, 6) for b in budgets]}
        try:
            self._proc.stdin.write(json.dumps(req) + "\n")
            self._proc.stdin.flush()
        except BrokenPipeError as exc:
            raise self._fail("closed its input") from exc
        got = self._readline()
        rows = got.get("rows")
        if not isinstance(rows, list):
            raise self._fail(f"answered without rows: {str(got)[:200]}")
        return rows

    def close(self) -> None:
        if self._proc is not None:
            if self._proc.stdin is not None:
                self._proc.stdin.close()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None
        if self._err is not None:
            self._err.close()
            self._err = None

    def __enter__(self) -> PressWorker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["PressWorker", "is_press"]
