"""Where a command's output goes: the conventions every ``kvstate`` command shares.

``--json`` prints exactly one JSON document on stdout, so ``kvstate ... --json | jq`` works; tables,
progress (:mod:`kvstate.lab.progress`) and notes then go to stderr. Without ``--json`` the table is the
output and goes to stdout. ``--out FILE`` is refused when the file exists unless ``--overwrite`` (a
directory ``--out`` follows :func:`kvstate.io_safety.check_output_dir`, the same rule), and both are checked
before any work starts. A *result* file (``--out`` of an evaluation or benchmark) is the exception:
runs are appended to it with their provenance (:func:`write_results`), never replaced silently;
``--overwrite`` starts it afresh.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Console

from kvstate.errors import OutputError
from kvstate.io_safety import check_output_file


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
    if path.exists() and not overwrite:
        raise OutputError(f"{option} {str(path)!r} already exists; pass --overwrite to replace it, or choose a "
                          "new file name")
    return path


def check_results_out(path: Path, *, overwrite: bool, option: str = "--out") -> Path:
    """An ``--out`` result file a run will be appended to: new, or an existing kvstate result file."""
    from kvstate.errors import InputFileError
    from kvstate.lab.provenance import read_runs

    check_output_file(path, option)
    if path.exists() and not overwrite:
        try:
            read_runs(path)
        except (InputFileError, UnicodeDecodeError):
            raise OutputError(f"{option} {str(path)!r} exists and is not a kvstate result file; runs are appended "
                              "only to result files — choose another file, or pass --overwrite to replace it") from None
    return path


def write_results(path: Path, result: dict[str, Any], provenance: dict[str, Any], *, overwrite: bool) -> None:
    """Append ``result`` as a run (with ``provenance``) to ``path``; ``overwrite`` drops the earlier runs."""
    from kvstate.lab.provenance import append_run

    if overwrite and path.exists():
        path.unlink()
    append_run(path, result, provenance)
