"""Numbers in ``docs/`` are generated: a results table there is a copy of a report table, refreshed by the report.

A Markdown page marks where a report table goes::

    <!-- kvstate:table depth "Sharing patterns per model" -->
    (the table: written by ``kvstate report --docs``)
    <!-- /kvstate:table -->

``depth`` is the section's key, the quoted text the start of the table's title; :func:`fill` replaces what lies
between the markers with that table rendered as Markdown (its title in bold above it, its note below), so a
superseded run cannot stay quoted once the report is rebuilt. :func:`hand_typed` finds the results tables
outside any marker — a table whose cells hold measured values (a number, a ratio, a share, an interval) — so a
test can refuse them (issue 42: "a test fails on a hand-typed number in a results table").

A dev-seed pilot the report does not show may be quoted as a table when the line right above it names its
files: ``<!-- kvstate:quoted docs/results/NAME.json [...] -->`` (only ``docs/results/``, where dev-seed runs live;
:func:`quoted_files` lists them so a test checks each exists). A result under ``models/`` is never quoted.

Ignores: numbers in running text (a sentence quoting a result names its file and run instead), tables that
only describe (every cell words or code).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstate.errors import KVStateError
from kvstate.lab.report.html import Section, Table

# markers count only on lines of their own (a page may show the syntax inline, as docs/lab.md does)
BLOCK = re.compile(r'^(?P<open><!-- kvstate:table (?P<section>[\w-]+) "(?P<title>[^"\n]+)" -->\n)(?P<body>.*?)'
                   r'^(?P<close><!-- /kvstate:table -->)$', re.S | re.M)
OPENS, CLOSES = re.compile(r"^<!-- kvstate:table ", re.M), re.compile(r"^<!-- /kvstate:table -->$", re.M)
# a cell that is a measured value: a number (thousands commas, decimals, sign), optionally a unit or ratio
# mark, optionally an interval after it; or an interval alone; or two such values split by " / " or " · "
_NUM = r"[-+−]?\d[\d,]*(?:\.\d+)?\s*(?:%|x|×|ms|s|B|KiB|MiB|GiB|M|K|points|pp)?"
_INTERVAL = r"\[\s*[-+−]?\d[\d,]*(?:\.\d+)?\s*,\s*[-+−]?\d[\d,]*(?:\.\d+)?\s*\]"
_VALUE = rf"(?:\*\*)?{_NUM}(?:\s*{_INTERVAL})?(?:\*\*)?"
MEASURED = re.compile(rf"^(?:{_VALUE}(?:\s*(?:/|·)\s*{_VALUE})*|{_INTERVAL})$")
INTERVAL = re.compile(_INTERVAL)
QUOTED = re.compile(r"<!-- kvstate:quoted (?P<paths>\S+(?: \S+)*) -->")


class DocsError(KVStateError):
    """A marker names no report table, or a page's markers do not pair up."""


def markdown(table: Table) -> str:
    """``table`` as Markdown: its title in bold, the table, its note in italics."""

    def cell(value: Any) -> str:
        if isinstance(value, float):
            text = "—" if value != value else f"{value:,.4g}"
        elif isinstance(value, bool):
            text = "yes" if value else "no"
        elif isinstance(value, int):
            text = f"{value:,}"
        else:
            text = str(value)
        return text.replace("|", "\\|").replace("\n", " ")

    out = [f"**{cell(table.title)}**", "", "| " + " | ".join(cell(c) for c in table.columns) + " |",
           "|" + "---|" * len(table.columns)]
    out += ["| " + " | ".join(cell(v) for v in row) + " |" for row in table.rows]
    if table.note:
        out += ["", f"*{cell(table.note)}*"]
    return "\n".join(out) + "\n"


def _find(sections: Sequence[Section], key: str, title: str) -> Table:
    matches = [s for s in sections if s.key == key]
    if not matches:
        raise DocsError(f'docs marker kvstate:table {key} "{title}": the report has no section {key!r} (sections: '
                        f"{', '.join(sorted({s.key for s in sections}))}); fix the marker or build that section")
    tables = [t for s in matches for t in (*s.tables, *s.details) if t.title.startswith(title)]
    if not tables:
        titles = "; ".join(t.title[:60] for s in matches for t in (*s.tables, *s.details))
        raise DocsError(f'docs marker kvstate:table {key} "{title}": no table of section {key!r} has a title '
                        f"starting so (its tables: {titles})")
    return tables[0]


def fill(text: str, sections: Sequence[Section]) -> str:
    """``text`` with every marked block replaced by its report table (markers kept)."""
    blocks = len(BLOCK.findall(text))
    if len(OPENS.findall(text)) != blocks or len(CLOSES.findall(text)) != blocks:
        raise DocsError("docs: a kvstate:table marker is not closed by <!-- /kvstate:table --> (or a closing marker "
                        "has no opening one); pair them up")
    return BLOCK.sub(lambda m: m["open"] + markdown(_find(sections, m["section"], m["title"])) + m["close"], text)


def markers(text: str) -> list[tuple[str, str]]:
    """The (section, title start) of every marked block."""
    return [(m["section"], m["title"]) for m in BLOCK.finditer(text)]


@dataclass(frozen=True)
class HandTyped:
    line: int  # 1-based line of the table's first body row with a measured value
    text: str


def _tables(lines: list[str]) -> Iterable[tuple[int, list[tuple[int, list[str]]]]]:
    """Each Markdown table: the index of its first line and its rows' (index, cells), separator rows left out."""
    i = 0
    while i < len(lines):
        if not lines[i].strip().startswith("|"):
            i += 1
            continue
        first, rows = i, []
        while i < len(lines) and lines[i].strip().startswith("|"):
            s = lines[i].strip()
            if s.endswith("|") and not re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", s):
                rows.append((i, [c.strip() for c in re.split(r"(?<!\\)\|", s)[1:-1]]))
            i += 1
        yield first, rows


def hand_typed(text: str) -> list[HandTyped]:
    """Tables outside any marked block, and not quoted from a ``docs/results`` file, with a cell (the first
    column aside: a row's label) holding a measured value: the first such row of each."""
    spans = [(m.start(), m.end()) for m in BLOCK.finditer(text)]
    lines = text.split("\n")
    starts, pos = [], 0
    for line in lines:
        starts.append(pos)
        pos += len(line) + 1
    out: list[HandTyped] = []
    for first, rows in _tables(lines):
        if any(a <= starts[first] < b for a, b in spans):
            continue
        m = QUOTED.fullmatch(lines[first - 1].strip()) if first else None
        if m is not None and all(p.startswith("docs/results/") for p in m["paths"].split()):
            continue
        hit = next((i for i, cells in rows if any(MEASURED.match(c) or INTERVAL.search(c) for c in cells[1:])), None)
        if hit is not None:
            out.append(HandTyped(hit + 1, lines[hit]))
    return out


def quoted_files(text: str) -> list[str]:
    """The files the page's quoted dev-seed tables name (repository-relative)."""
    found = (QUOTED.fullmatch(line.strip()) for line in text.split("\n"))
    return [p for m in found if m is not None for p in m["paths"].split()]


def update(paths: Sequence[Path], sections: Sequence[Section]) -> list[Path]:
    """Refresh every marked block in ``paths``; the pages that changed (written whole, atomically)."""
    from kvstate.io_safety import write_text_atomic

    changed = []
    for p in paths:
        text = p.read_text(encoding="utf-8")
        new = fill(text, sections)
        if new != text:
            write_text_atomic(p, new)
            changed.append(p)
    return changed


__all__ = ["BLOCK", "DocsError", "HandTyped", "fill", "hand_typed", "markdown", "markers", "quoted_files", "update"]
