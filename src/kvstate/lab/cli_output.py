"""Where a command's output goes: the conventions every ``kvstate`` command shares.

``--json`` prints exactly one JSON document on stdout, so ``kvstate ... --json | jq`` works; tables,
progress (:mod:`kvstate.lab.progress`) and notes then go to stderr. Without ``--json`` the table is the
output and goes to stdout. ``--out FILE`` is refused when the file exists unless ``--overwrite`` (a
directory ``--out`` follows :func:`kvstate.io_safety.check_output_dir`, the same rule), and both are checked
before any work starts. A *result* file (``--out`` of an evaluation or benchmark) is the exception:
runs are appended to it with their provenance (:func:`write_results`), never replaced silently;
``--overwrite`` starts it afresh. A file a checksum manifest covers (a model's weights, config, tokenizer,
training state; a router; a codec) is never an output, with or without ``--overwrite``. A generated card
(``README.md``) replaces only a card its command wrote (:func:`check_card_out`). ``--threads`` is checked
by :func:`set_threads` (a bad count is one clear error, not torch's ``RuntimeError``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Console

from kvstate.errors import KVStateError, OutputError
from kvstate.integrity import is_trusted_file
from kvstate.io_safety import check_output_file

MAX_THREADS = 1024


def table_console(as_json: bool) -> Console:
    """The console for a command's table: stdout normally, stderr under ``--json`` (stdout holds the JSON)."""
    return Console(stderr=as_json)


def notes_console() -> Console:
    """The console for notes, warnings and status lines: always stderr."""
    return Console(stderr=True)


def print_json(document: Any) -> None:
    """Write ``document`` as one JSON line on stdout (the only thing a ``--json`` command prints there)."""
    sys.stdout.write(json.dumps(document) + "\n")
    sys.stdout.flush()


def check_out_file(path: Path, *, overwrite: bool, option: str = "--out") -> Path:
    """Raise :class:`OutputError` unless a file can be written at ``path``; an existing file needs ``overwrite``."""
    check_output_file(path, option)
    _check_untrusted(path, option)
    if path.exists() and not overwrite:
        raise OutputError(f"{option} {str(path)!r} already exists; pass --overwrite to replace it, or choose a "
                          "new file name")
    return path


def check_results_out(path: Path, *, overwrite: bool, option: str = "--out") -> Path:
    """An ``--out`` result file a run will be appended to: new, or an existing kvstate result file."""
    from kvstate.errors import InputFileError
    from kvstate.lab.provenance import read_runs

    check_output_file(path, option)
    _check_untrusted(path, option)
    if path.exists() and not overwrite:
        try:
            runs = read_runs(path)
            legacy = len(runs) == 1 and "provenance" not in runs[0]
            if legacy and not {"results", "runs"} & set(runs[0]):  # a JSON file, but not results (a config, ...)
                raise InputFileError("no results")
        except (InputFileError, UnicodeDecodeError, OSError):
            raise OutputError(f"{option} {str(path)!r} exists and is not a kvstate result file; runs are appended "
                              "only to result files — choose another file, or pass --overwrite to replace it") from None
    return path


def write_results(path: Path, result: dict[str, Any], provenance: dict[str, Any], *, overwrite: bool) -> None:
    """Append ``result`` as a run (with ``provenance``) to ``path``; ``overwrite`` drops the earlier runs."""
    from kvstate.lab.provenance import append_run

    if overwrite and path.exists():
        path.unlink()
    append_run(path, result, provenance)


def _check_untrusted(path: Path, option: str) -> None:
    if is_trusted_file(path):
        raise OutputError(f"{option} {str(path)!r} is covered by the checksum manifest of {str(path.parent)!r} (part of "
                          "a saved model, router or codec); it is never an output — choose another file")


def check_card_out(path: Path, marker: str, *, overwrite: bool, option: str = "card") -> Path:
    """A card (``README.md``) to (re)write: new, written by the card command (it holds ``marker``), or
    ``overwrite``; a hand-written or foreign file there is refused."""
    check_output_file(path, option)
    _check_untrusted(path, option)
    if path.exists() and not overwrite:
        try:
            ours = marker in path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            ours = False
        if not ours:
            raise OutputError(f"{option} {str(path)!r} exists and was not written by this card command; pass "
                              "--overwrite to replace it")
    return path


def set_threads(n: object, option: str = "--threads") -> int:
    """Check a thread count (1..MAX_THREADS) and give it to torch."""
    import torch

    from kvstate.validate import check_int

    threads = check_int(option, n, 1, MAX_THREADS, error=KVStateError)
    torch.set_num_threads(threads)
    return threads
