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

BLOCK = re.compile(r'(?P<open><!-- kvstate:table (?P<section>[\w-]+) "(?P<title>[^"\n]+)" -->\n)(?P<body>.*?)'
                   r'(?P<close><!-- /kvstate:table -->)', re.S)
# a cell that is a measured value: a number (thousands commas, decimals, sign), optionally a unit or ratio
# mark, optionally an interval after it; or an interval alone; or two such values split by " / " or " · "
_NUM = r"[-+−]?\d[\d,]*(?:\.\d+)?\s*(?:%|x|×|ms|s|B|KiB|MiB|GiB|M|K|points|pp)?"
_INTERVAL = r"\[\s*[-+−]?\d[\d,]*(?:\.\d+)?\s*,\s*[-+−]?\d[\d,]*(?:\.\d+)?\s*\]"
_VALUE = rf"(?:\*\*)?{_NUM}(?:\s*{_INTERVAL})?(?:\*\*)?"
MEASURED = re.compile(rf"^(?:{_VALUE}(?:\s*(?:/|·)\s*{_VALUE})*|{_INTERVAL})$")
INTERVAL = re.compile(_INTERVAL)


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
    if text.count("<!-- kvstate:table ") != len(BLOCK.findall(text)) or text.count("<!-- /kvstate:table -->") != \
            len(BLOCK.findall(text)):
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


def _rows(lines: list[str]) -> Iterable[tuple[int, list[str]]]:
    for i, line in enumerate(lines):
        s = line.strip()
        if s.startswith("|") and s.endswith("|") and not re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", s):
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", s)[1:-1]]
            yield i, cells


def hand_typed(text: str) -> list[HandTyped]:
    """Table rows outside any marked block whose cells (the first column aside: a row's label) hold a measured
    value, one per table."""
    spans = [(m.start(), m.end()) for m in BLOCK.finditer(text)]
    lines = text.split("\n")
    starts, pos = [], 0
    for line in lines:
        starts.append(pos)
        pos += len(line) + 1
    out: list[HandTyped] = []
    last = -2
    for i, cells in _rows(lines):
        if any(a <= starts[i] < b for a, b in spans):
            continue
        if any(MEASURED.match(c) or INTERVAL.search(c) for c in cells[1:]):
            if i != last + 1:  # a new table
                out.append(HandTyped(i + 1, lines[i]))
            last = i
        elif i == last + 1:
            last = i
    return out


def update(paths: Sequence[Path], sections: Sequence[Section]) -> list[Path]:
    """Refresh every marked block in ``paths``; the pages that changed (written whole, atomically)."""
    from kvstate.io_safety import atomic_write_text

    changed = []
    for p in paths:
        text = p.read_text(encoding="utf-8")
        new = fill(text, sections)
        if new != text:
            atomic_write_text(p, new)
            changed.append(p)
    return changed


__all__ = ["BLOCK", "DocsError", "HandTyped", "fill", "hand_typed", "markdown", "markers", "update"]
