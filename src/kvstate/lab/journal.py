"""Resumable long measurements: each finished unit of work is journaled, so an interrupted run continues.

A measurement that takes hours on this machine (the SEKV grid, the kvpress presses, the transfer
bench) is a list of independent *units* (one item under every method, one chunk of items through
a press runner). :class:`Journal` appends each finished unit's records as one JSON line, flushed and
``fsync``'d, to a file beside the run's result file; a rerun of the same measurement reads the finished
units back and computes only the rest. The protocol is unchanged: the rerun produces the same rows the
unbroken run would (units are deterministic given their identity), and its provenance says it was
resumed (``parts``) and sums the wall time of every part.

The journal's first line is the run's *identity* — its settings plus the digests of the code and models
it depends on (:mod:`kvstate.lab.provenance`). A journal whose identity differs from this run's (other
settings, changed code or weights) is never mixed in: it is moved aside as ``*.stale`` (``*.stale.1``,
``*.stale.2``, ... when that name is taken: a set-aside journal is never overwritten) and the run starts
afresh. A line cut short by a kill is dropped on read. When the result has been written, :meth:`close`
removes the journal.

The file is hidden (``.<result name>.journal``) so the directory's checksum manifest and model digests
ignore it. Ignored: two processes journaling the same run at once (the second one's lines interleave).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvstate.lab.provenance import code_digest, model_digest

FORMAT = "kvstate-journal/1"


def journal_path(result: str | Path) -> Path:
    """Where the journal of a run appended to ``result`` lives: a hidden file beside it."""
    p = Path(result)
    return p.with_name(f".{p.name}.journal")


def identity(settings: dict[str, Any], code: Sequence[str], models: Sequence[str | Path]) -> dict[str, Any]:
    """What makes two runs the same measurement: ``settings`` (JSON values), the code digest of ``code``
    (paths under ``src/kvstate``) and the digest of every model directory read."""
    return {"settings": json.loads(json.dumps(settings, sort_keys=True, default=str)),
            "code": code_digest(code), "models": {str(m): model_digest(m) for m in models}}


def _set_aside(path: Path) -> Path:
    """Move ``path`` to the first of ``<name>.stale``, ``<name>.stale.1``, ... that does not exist yet; returns it.

    A hard link fails when its name exists, so no earlier set-aside journal is ever overwritten, and the
    journal is under one of its two names at every moment."""
    for n in itertools.count():
        target = path.with_name(path.name + ".stale" + (f".{n}" if n else ""))
        try:
            os.link(path, target)
        except FileExistsError:
            continue
        path.unlink()
        return target
    raise AssertionError("unreachable")


class Journal:
    """Finished units of one run, on disk: :meth:`get` a unit's records (``None`` if not done), :meth:`put`
    them when it finishes, :meth:`close` once the result is written."""

    def __init__(self, path: str | Path, ident: dict[str, Any]) -> None:
        self.path = Path(path)
        self.identity = json.loads(json.dumps(ident, sort_keys=True, default=str))
        self.key = hashlib.sha256(json.dumps(self.identity, sort_keys=True).encode()).hexdigest()[:16]
        self.units: dict[str, Any] = {}
        self.seconds = 0.0  # wall time of the earlier parts' finished units
        self.parts = 1
        self.set_aside: Path | None = None  # a journal of another run, moved aside
        self._t = time.perf_counter()
        self._read()
        self._earlier = len(self.units)
        self._fh: Any = None

    def _read(self) -> None:
        if not self.path.is_file():
            return
        lines = self.path.read_text(encoding="utf-8", errors="replace").splitlines()
        try:
            head = json.loads(lines[0]) if lines else {}
        except json.JSONDecodeError:
            head = {}
        if not (isinstance(head, dict) and head.get("format") == FORMAT and head.get("key") == self.key):
            self.set_aside = _set_aside(self.path)
            return
        parts = {int(head.get("part", 1))}
        for line in lines[1:]:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:  # the last line of a killed part
                continue
            if isinstance(rec, dict) and isinstance(rec.get("unit"), str) and "records" in rec:
                self.units[rec["unit"]] = rec["records"]
                self.seconds += float(rec.get("seconds", 0.0))
                parts.add(int(rec.get("part", 1)))
        self.parts = max(parts) + 1 if self.units else 1

    @property
    def resumed(self) -> int:
        """Units finished by earlier parts."""
        return self._earlier

    def get(self, unit: str) -> Any:
        return self.units.get(unit)

    def put(self, unit: str, records: Any) -> None:
        """Record a finished unit (durably: flushed and fsync'd before returning)."""
        now = time.perf_counter()
        if self._fh is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fresh = not self.path.is_file()
            torn = not fresh and not self.path.read_bytes().endswith(b"\n")
            self._fh = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (kept open for the run)
            if torn:  # end the cut line, so it stays one unreadable line
                self._fh.write("\n")
            if fresh:
                self._fh.write(json.dumps({"format": FORMAT, "key": self.key, "identity": self.identity}) + "\n")
        line = {"unit": unit, "part": self.parts, "seconds": round(now - self._t, 3), "records": records}
        self._fh.write(json.dumps(line, allow_nan=True) + "\n")
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self.units[unit] = records
        self._t = now

    def close(self, *, remove: bool = True) -> None:
        """Stop journaling; ``remove`` (once the run's result is written) deletes the journal."""
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        if remove:
            self.path.unlink(missing_ok=True)

    def stamp(self, provenance: dict[str, Any]) -> dict[str, Any]:
        """``provenance`` (from ``Recorder.finish()``) with the parts recorded: ``wall_seconds`` becomes the
        sum over every part, ``parts`` / ``resumed_units`` say how the run was split."""
        wall = float(provenance.get("wall_seconds") or 0.0) + self.seconds
        return {**provenance, "wall_seconds": round(wall, 1), "parts": self.parts, "resumed_units": self.resumed}


def open_journal(result: str | Path | None, settings: dict[str, Any], code: Sequence[str],
                 models: Sequence[str | Path], say: Callable[[str], None]) -> Journal | None:
    """The journal of a run recorded to ``result`` (``None`` when nothing is recorded), announced through ``say``:
    where an earlier part left off, or that another run's journal was moved aside."""
    if result is None:
        return None
    journal = Journal(journal_path(result), identity(settings, code, models))
    if journal.set_aside is not None:
        say(f"a journal of another run was moved aside to {journal.set_aside}")
    if journal.resumed:
        say(f"resuming: {journal.resumed} units finished by earlier parts ({journal.path})")
    return journal


def once(journal: Journal | None, unit: str, compute: Callable[[], Any]) -> Any:
    """``compute()`` (a JSON value), or the value ``unit`` already has in ``journal``; recorded when computed."""
    if journal is not None:
        got = journal.get(unit)
        if got is not None:
            return got
    value = compute()
    if journal is not None:
        journal.put(unit, value)
    return value


__all__ = ["FORMAT", "Journal", "identity", "journal_path", "once", "open_journal"]
