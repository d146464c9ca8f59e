"""The result file's format and its reader: the one layer under both the provenance recorder and the seed ledger.

A result file under ``models/`` (or ``docs/results/``) is ``{"format": FORMAT, "runs": [run, ...]}``, oldest run
first; :func:`read_runs` also reads the two older forms (a bare run object, JSON lines). Writing stays in
:mod:`kvstate.lab.provenance` (``append_run``, which passes the seed ledger, :mod:`kvstate.lab.ledger`, first);
both import from here, so neither imports the other at module level (issue 42, item 10).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvstate.errors import InputFileError

FORMAT = "kvstate-results/1"
SRC = Path(__file__).resolve().parents[1]  # src/kvstate
REPO = SRC.parents[1]


def read_runs(path: str | Path) -> list[dict[str, Any]]:
    """Every run recorded in a result file (oldest first); a pre-provenance file reads as one bare run."""
    p = Path(path)
    text = p.read_text(encoding="utf-8")
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        try:  # the older JSON-lines form: the last line is the run
            doc = json.loads(text.strip().splitlines()[-1])
        except (json.JSONDecodeError, IndexError):
            raise InputFileError(f"{p}: not a JSON result file; regenerate it (make reproduce) or remove it") from None
    if isinstance(doc, dict) and doc.get("format") == FORMAT:
        runs = doc.get("runs")
        if not isinstance(runs, list) or not all(isinstance(r, dict) for r in runs):
            raise InputFileError(f"{p}: a {FORMAT} file whose 'runs' is not a list of objects; regenerate it")
        return runs
    if isinstance(doc, dict) and "format" in doc:
        raise InputFileError(f"{p}: result format {doc['format']!r}, expected {FORMAT!r}; regenerate it")
    return [doc if isinstance(doc, dict) else {"rows": doc}]


__all__ = ["FORMAT", "REPO", "SRC", "read_runs"]
