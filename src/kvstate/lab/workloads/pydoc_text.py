"""A held-out English text large enough for ~100 perplexity windows of 1K tokens: Python's own reference topics.

The licence texts of :mod:`kvstate.lab.workloads.realtext` hold out ~9K tokens (enough for dev pilots, not for a
headline of >= 100 windows). The Python standard library ships ``pydoc_data.topics`` — the language reference's
topics as plain English prose with code, ~465K characters (~113K SmolLM2 tokens) — with every interpreter, so it
needs no download. It was never used for any fine-tune or haystack here. Its text changes with the interpreter's
patch version: :func:`source` names the version and a digest of the text, which a run records in its settings.
"""

from __future__ import annotations

import hashlib
import sys
from typing import Any

from kvstate.errors import KVStateError


def pydoc_text() -> str:
    """Every topic of ``pydoc_data.topics`` in sorted key order, separated by blank lines."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def source() -> str:
    text = pydoc_text()
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    return (f"pydoc_data.topics of Python {sys.version_info.major}.{sys.version_info.minor}."
            f"{sys.version_info.micro} (sha256 {digest}, {len(text):,} characters)")


def windows(tok: Any, text: str, length: int, n: int, what: str = "the text") -> list[list[int]]:
    """The first ``n`` disjoint ``length``-token windows of ``text``; refused when it has fewer."""
    if length < 2 or n < 1:
        raise KVStateError(f"windows: length {length} and n {n} must be >= 2 and >= 1")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    if len(ids) < n * length:
        raise KVStateError(f"--n {n} windows of {length} tokens need {n * length:,} tokens; {what} has {len(ids):,}: "
                           f"ask for at most --n {len(ids) // length}")
    return [[int(i) for i in ids[k * length:(k + 1) * length]] for k in range(n)]


__all__ = ["pydoc_text", "source", "windows"]
