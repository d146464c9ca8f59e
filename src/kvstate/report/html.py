"""A small, dependency-free HTML report: sections of text, tables and PNG figures.

Each technique contributes a :class:`Section`; :func:`write_report` writes ``index.html`` (figures as
files next to it) and ``summary.json`` atomically (temp file + rename), so a report directory is never
left half-written.
"""

from __future__ import annotations

import html
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Table:
    title: str
    columns: list[str]
    rows: list[list[Any]]


@dataclass
class Figure:
    title: str
    filename: str  # PNG written into the report directory by the section
    caption: str = ""


@dataclass(frozen=True)
class HeadlineRow:
    """One target a technique is measured against, with this run's value (never fixed text)."""

    technique: str  # e.g. "position (sparse prefix caching)"
    target: str  # what is promised, e.g. "capture overhead <= 1.10x a plain prefill"
    measured: str  # this run's value, formatted, e.g. "1.04x"
    met: bool | None  # None when the run could not decide (say why in `measured`)


@dataclass
class Section:
    key: str  # short id, also the summary.json key
    title: str
    intro: str = ""
    tables: list[Table] = field(default_factory=list)
    figures: list[Figure] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)  # machine-readable numbers for summary.json
    headline: list[HeadlineRow] = field(default_factory=list)  # rows for the report's headline table


def atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.4g}"
    if isinstance(value, int):
        return f"{value:,}"
    return html.escape(str(value))


def render(sections: list[Section], title: str = "kvstate report") -> str:
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>{html.escape(title)}</title>",
        "<style>body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em}"
        "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}"
        "th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}img{max-width:100%}"
        "figcaption{color:#555;font-size:90%}</style></head><body>",
        f"<h1>{html.escape(title)}</h1><ul>",
    ]
    parts += [f"<li><a href='#{s.key}'>{html.escape(s.title)}</a></li>" for s in sections]
    parts.append("</ul>")
    for s in sections:
        parts.append(f"<h2 id='{s.key}'>{html.escape(s.title)}</h2>")
        if s.intro:
            parts.append(f"<p>{html.escape(s.intro)}</p>")
        for t in s.tables:
            parts.append(f"<h3>{html.escape(t.title)}</h3><table><tr>")
            parts += [f"<th>{html.escape(c)}</th>" for c in t.columns]
            parts.append("</tr>")
            for row in t.rows:
                parts.append("<tr>" + "".join(f"<td>{_cell(v)}</td>" for v in row) + "</tr>")
            parts.append("</table>")
        for f in s.figures:
            parts.append(
                f"<figure><img src='{html.escape(f.filename)}' alt='{html.escape(f.title)}'>"
                f"<figcaption>{html.escape(f.title)}. {html.escape(f.caption)}</figcaption></figure>"
            )
    parts.append("</body></html>")
    return "\n".join(parts)


def write_report(out_dir: Path, sections: list[Section]) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    index = out_dir / "index.html"
    atomic_write_text(index, render(sections))
    summary = {s.key: s.summary for s in sections}
    atomic_write_text(out_dir / "summary.json", json.dumps(summary, indent=2, sort_keys=True))
    return index
