"""The report page: a headline of targets met or missed, then one section per technique, as a results section.

How a technique adds a section (the whole interface)
----------------------------------------------------
Write a section module (``src/kvstate/lab/<axis>/section.py``) with ``build(out_dir: Path, models_dir: Path) -> Section`` and
add one line to ``SECTIONS`` in :mod:`kvstate.lab.make.build`. ``build`` writes its PNG figures into
``out_dir`` (a temporary directory that replaces the report only when every section has finished) and
returns a :class:`Section`:

- ``key``: short id; the section's anchor (``index.html#key``) and its key under ``"sections"`` in
  ``summary.json``.
- ``title``: the technique in words, e.g. ``"Depth: stochastic KV routing (R-CLA)"`` — never an internal
  label; ``paper``: the title of the paper it implements (shown under the heading).
- ``headline``: one :class:`HeadlineRow` per target the technique is measured against, with this run's
  value and whether it met the target. Every number in ``measured`` must also be in ``summary`` (a test
  checks the page's headline numbers against ``summary.json``).
- ``conclusion``: one paragraph of what the reader should conclude, with this run's numbers in it.
- ``intro``: how it was measured (workload, n, seeds, hardware), shown in smaller print.
- ``figures``: :class:`Figure` (a PNG file name in ``out_dir``, no directories), shown before the tables.
  Use :mod:`kvstate.lab.report.plots` for a method's colour and for annotated heatmaps.
- ``tables``: compact tables (pivoted: methods as columns, budgets or lengths as rows; see :func:`pivot`
  and :func:`pct`). A table longer than ``COLLAPSE_ROWS`` rows is moved into the collapsed block.
- ``details``: the full long-format tables, shown in a collapsed ``<details>`` block.
- ``summary``: the machine-readable numbers (JSON-serialisable) for ``summary.json``.

Minimal example::

    return Section(key="depth", title="Depth: stochastic KV routing (R-CLA)", paper="...",
                   conclusion=f"Sharing every other layer's KV halves the cache at {drop:.1%} accuracy loss.",
                   figures=[Figure("Accuracy vs KV kept", "depth_accuracy.png", "n = 20 per cell.")],
                   tables=[pivot(rows, "budget", "method", "accuracy", fmt=pct)],
                   headline=[HeadlineRow("depth (R-CLA)", "accuracy drop <= 2 pp at 50% KV",
                                         f"{drop * 100:.1f} pp", drop <= 0.02)],
                   summary={"accuracy_drop": drop})

:func:`render` turns sections into the page; :func:`write_report` writes ``index.html`` and
``summary.json`` (schema ``SCHEMA_VERSION``) into a directory; :mod:`kvstate.lab.make.build` runs the sections
and swaps the finished directory into place.
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvstate.errors import KVStateError
from kvstate.io_safety import write_text_atomic

SCHEMA_VERSION = 4  # summary.json: {schema_version, generator, run, verdicts, headline, headline_counts, checks, notes,
#                    sections}; each headline row carries seeds, n, tasks, excluded_tasks (timing: repeats, ci)
GENERATOR = "kvstate report"  # marks a directory as a kvstate report (index.html meta tag, summary.json)
COLLAPSE_ROWS = 15  # a compact table longer than this goes into the collapsed full-data block


@dataclass
class Table:
    title: str
    columns: list[str]
    rows: list[list[Any]]
    note: str = ""  # one line under the table (units, n, what a blank cell means)


@dataclass
class Figure:
    title: str
    filename: str  # PNG written into the report directory by the section (a bare file name)
    caption: str = ""
    alt: str = ""  # text for screen readers; the title when empty


SOURCES = ("run", "artifact")
STATUSES = ("met", "missed", "undecided", "stale", "missing")
KINDS = ("result", "check")  # a check holds by construction (a cap, a constant): shown apart, never counted as met
VERDICTS = ("works", "partly", "not yet")


@dataclass(frozen=True)
class HeadlineRow:
    """One target a technique is measured against, with its value, where it came from and its status.

    ``source`` says whether this report run measured the value (``"run"``) or read it from a committed
    result file (``"artifact"``, with ``artifact`` / ``commit`` / ``command`` from the file's provenance;
    build such rows with :func:`artifact_row`). A rate carries its 95% interval in ``ci`` and its status
    comes from the interval (:func:`kvstate.lab.stats.decide`): ``met`` / ``missed`` / ``undecided``.
    ``stale`` / ``missing`` mark an artifact that no longer describes the code or models, or is absent.
    """

    technique: str  # e.g. "position (sparse prefix caching)"
    target: str  # what is promised, e.g. "capture overhead <= 1.10x a plain prefill"
    measured: str  # the value, formatted, e.g. "1.04x" (never fixed text)
    met: bool | None = None  # for checks without an interval; None when undecided
    source: str = field(default="", kw_only=True)  # "run" | "artifact"
    status: str = field(default="", kw_only=True)  # met | missed | undecided | stale | missing ("" → from met)
    ci: tuple[float, float] | None = field(default=None, kw_only=True)  # 95% interval of the measured rate
    rate: bool = field(default=False, kw_only=True)  # the value is a rate / estimate: ci is required
    artifact: str | None = field(default=None, kw_only=True)  # result file (repository-relative)
    commit: str | None = field(default=None, kw_only=True)  # commit recorded in the file's provenance
    command: str | None = field(default=None, kw_only=True)  # the command that regenerates the file
    seeds: tuple[int, ...] | None = field(default=None, kw_only=True)  # the seeds the value rests on
    n: int | None = field(default=None, kw_only=True)  # items (texts, requests, repeats) per cell
    tasks: tuple[str, ...] | None = field(default=None, kw_only=True)  # tasks pooled into the value
    excluded_tasks: dict[str, float] | None = field(default=None, kw_only=True)  # unsolved by the reference: beside
    repeats: int | None = field(default=None, kw_only=True)  # interleaved repeats (a timing row)
    timing: bool = field(default=False, kw_only=True)  # a timing target: needs repeats (>= 5) and its spread (ci)
    kind: str = field(default="result", kw_only=True)  # "result" | "check" (holds by construction)
    because: str = field(default="", kw_only=True)  # a check: what it follows from
    recorded: str = field(default="", kw_only=True)  # a stale file: the status its recorded numbers decide

    def __post_init__(self) -> None:
        if self.met is not None:  # numpy.bool_ from a comparison of numpy numbers is not `True`
            object.__setattr__(self, "met", bool(self.met))
        if self.source not in SOURCES:
            raise KVStateError(f"HeadlineRow {self.target!r}: source={self.source!r}; pass source='run' for a "
                               "value measured by this report run or build it with artifact_row() for a file")
        status = self.status or {True: "met", False: "missed", None: "undecided"}[self.met]
        if status not in STATUSES:
            raise KVStateError(f"HeadlineRow {self.target!r}: status={status!r}; one of {', '.join(STATUSES)}")
        object.__setattr__(self, "status", status)
        if status in ("met", "missed") and self.met is None:
            object.__setattr__(self, "met", status == "met")
        if self.ci is not None:
            lo, hi = (float(x) for x in self.ci)
            object.__setattr__(self, "ci", (lo, hi))
        if self.rate and self.ci is None and status not in ("stale", "missing"):
            raise KVStateError(f"HeadlineRow {self.target!r}: a rate needs its interval (ci=(lo, hi))")
        if self.kind not in KINDS:
            raise KVStateError(f"HeadlineRow {self.target!r}: kind={self.kind!r}; one of {', '.join(KINDS)}")
        if self.kind == "check" and not self.because:
            raise KVStateError(f"HeadlineRow {self.target!r}: a check says what it holds by (because=...)")
        for name in ("seeds", "tasks"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, tuple(value))
        if self.timing and status not in ("stale", "missing"):
            from kvstate.lab.stats import MIN_REPEATS

            if self.repeats is None or self.repeats < MIN_REPEATS or self.ci is None:
                raise KVStateError(f"HeadlineRow {self.target!r}: a timing row needs >= {MIN_REPEATS} interleaved "
                                   f"repeats and their spread (repeats={self.repeats}, ci={self.ci})")
        if self.source == "artifact" and not (self.artifact and self.command):
            raise KVStateError(f"HeadlineRow {self.target!r}: an artifact row names its file and the command "
                               "that regenerates it (use artifact_row)")


def run_row(technique: str, target: str, measured: str, met: bool | None = None, *, status: str = "",
            ci: tuple[float, float] | None = None, rate: bool = False, **about: Any) -> HeadlineRow:
    """A headline row measured by this report run (``about``: seeds, n, tasks, excluded_tasks, repeats, timing)."""
    return HeadlineRow(technique, target, measured, met, source="run", status=status, ci=ci, rate=rate, **about)


def _from_provenance(art: Any, about: dict[str, Any]) -> dict[str, Any]:
    """Seeds, n and tasks a row rests on, from the file's provenance where the section passed none."""
    prov = art.provenance if art.run is not None else {}
    out = dict(about)
    if out.get("seeds") is None and isinstance(prov.get("seeds"), list):
        out["seeds"] = tuple(int(x) for x in prov["seeds"])
    if out.get("n") is None and isinstance(prov.get("n"), int):
        out["n"] = prov["n"]
    if out.get("tasks") is None and isinstance(prov.get("tasks"), list):
        out["tasks"] = tuple(str(t) for t in prov["tasks"])
    raw = prov.get("settings")
    settings: dict[str, Any] = raw if isinstance(raw, dict) else {}
    if out.get("repeats") is None and out.get("timing") and isinstance(settings.get("repeats"), int):
        out["repeats"] = settings["repeats"]
    return out


def artifact_row(art: Any, technique: str, target: str, measured: str, met: bool | None = None, *,
                 status: str = "", ci: tuple[float, float] | None = None, rate: bool = False,
                 **about: Any) -> HeadlineRow:
    """A headline row read from a committed result file (a :class:`kvstate.lab.provenance.Artifact`).

    A stale or missing file marks the row so, names why and the command that regenerates it: a stale
    number is never shown as current. ``about`` (seeds, n, tasks, excluded_tasks, repeats, timing, kind,
    because) defaults to the file's provenance for seeds, n and tasks
    (:func:`kvstate.lab.experiment.headline_fields` gives them from an experiment's decision).
    """
    about = _from_provenance(art, about)
    if art.status != "current":
        note = f"{art.status}: {art.reason} — regenerate with `{art.command}`"
        shown = f"{measured} [{note}]" if art.status == "stale" and measured else note
        recorded = (status or {True: "met", False: "missed", None: "undecided"}[None if met is None else bool(met)]
                    ) if art.status == "stale" and measured else ""
        return HeadlineRow(technique, target, shown, None, source="artifact", status=art.status, ci=ci, rate=rate,
                           artifact=art.path, commit=art.commit, command=art.command, recorded=recorded, **about)
    return HeadlineRow(technique, target, measured, met, source="artifact", status=status, ci=ci, rate=rate,
                       artifact=art.path, commit=art.commit, command=art.command, **about)


def check_row(technique: str, claim: str, holds: bool, because: str, measured: str = "", art: Any = None,
              **about: Any) -> HeadlineRow:
    """A property that holds by construction (a cap, a constant): verifies the code, is not a result.

    Shown in the checks table apart from the targets and never counted as met
    (:class:`kvstate.lab.stats.Check`); a failing check is a bug, shown as ``missed``.
    """
    shown = measured or ("holds" if holds else "fails")
    if art is not None:
        return artifact_row(art, technique, claim, shown, bool(holds), kind="check", because=because, **about)
    return run_row(technique, claim, shown, bool(holds), kind="check", because=because, **about)


@dataclass
class Section:
    key: str  # short id: the anchor and the summary.json key
    title: str  # the technique in words (not an internal label)
    intro: str = ""  # how it was measured
    tables: list[Table] = field(default_factory=list)  # compact tables, shown after the figures
    figures: list[Figure] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)  # machine-readable numbers for summary.json
    headline: list[HeadlineRow] = field(default_factory=list)  # rows for the report's headline table
    notes: list[str] = field(default_factory=list)  # facts shown under the headline that cannot be missed
    conclusion: str = ""  # what the reader should conclude, with this run's numbers
    paper: str = ""  # title of the paper the technique comes from
    details: list[Table] = field(default_factory=list)  # full long-format data, collapsed
    seconds: float | None = None  # wall time of the section's build (filled in by the report builder)
    axis: str = ""  # the axis it belongs to, for the verdicts at the top (set by the report builder)
    claim: tuple[str, ...] = ()  # its axis's claim: a row whose target contains one of these states it


def pct(x: float | None, digits: int = 1) -> str:
    """A share in [0, 1] as a percentage with fixed precision ("—" for a missing value)."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    return f"{100 * x:.{digits}f}%"


def pivot(records: Sequence[dict[str, Any]], row: str, column: str, value: str, title: str = "",
          fmt: Callable[[Any], str] = str, row_label: str | None = None, note: str = "") -> Table:
    """Long-format records → one row per ``row`` value, one column per ``column`` value (first-seen order)."""
    rows_seen: dict[Any, None] = {}
    cols_seen: dict[Any, None] = {}
    cells: dict[tuple[Any, Any], Any] = {}
    for r in records:
        rows_seen.setdefault(r[row])
        cols_seen.setdefault(r[column])
        cells[(r[row], r[column])] = r[value]
    body = [[rv, *(fmt(cells[(rv, cv)]) if (rv, cv) in cells else "—" for cv in cols_seen)] for rv in rows_seen]
    return Table(title, [row_label or row, *(str(c) for c in cols_seen)], body, note)


def _e(text: Any) -> str:
    return html.escape(str(text), quote=True)


def _cell(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return "—" if math.isnan(value) else f"{value:,.4g}"
    if isinstance(value, int):
        return f"{value:,}"
    return _e(value)


def _status(status: str) -> str:
    cls = {"met": "met", "missed": "missed", "undecided": "open", "stale": "stale", "missing": "stale"}[status]
    return f"<span class='{cls}'>{_e(status)}</span>"


def _ci(row: HeadlineRow) -> str:
    return "" if row.ci is None else f"[{row.ci[0]:.3g}, {row.ci[1]:.3g}]"


def _table(t: Table, cls: str = "") -> str:
    out = [f"<table class='{cls}'>" if cls else "<table>"]
    if t.title:
        out.append(f"<caption>{_e(t.title)}</caption>")
    out.append("<thead><tr>" + "".join(f"<th>{_e(c)}</th>" for c in t.columns) + "</tr></thead><tbody>")
    out += ["<tr>" + "".join(f"<td>{_cell(v)}</td>" for v in row) + "</tr>" for row in t.rows]
    out.append("</tbody></table>")
    if t.note:
        out.append(f"<p class='note'>{_e(t.note)}</p>")
    return "\n".join(out)


def _check_figure_name(s: Section, f: Figure) -> None:
    if not f.filename or Path(f.filename).name != f.filename or f.filename.startswith("."):
        raise KVStateError(f"report section {s.key!r}: figure file name {f.filename!r} must be a bare file name "
                           "inside the report directory (no folders); save the PNG into out_dir.")


_STYLE = """
body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;max-width:1100px;margin:1.5em auto;padding:0 1em;
  color:#1a1a1a;line-height:1.45}
h1{margin-bottom:.2em} h2{margin-top:2.2em;border-bottom:2px solid #ddd;padding-bottom:.2em}
.paper{color:#555;margin-top:-.6em} .lede{font-size:110%} .intro,.note,figcaption,.settings{color:#555;font-size:90%}
.conclusion{font-size:105%}
table{border-collapse:collapse;margin:.8em 0;font-variant-numeric:tabular-nums;max-width:100%}
td,th{overflow-wrap:anywhere} table.headline td.source{font-size:85%;max-width:16em}
ul.verdicts{font-size:105%;padding-left:1.2em} ul.verdicts li{margin:.25em 0}
caption{text-align:left;font-weight:600;padding:.3em 0}
td,th{border:1px solid #ccc;padding:3px 8px;text-align:right} th{background:#f3f3f3}
td:first-child,th:first-child{text-align:left}
table.headline td,table.headline th{text-align:left}
.met{color:#1a7f37;font-weight:700} .stale{color:#6a1b9a;font-weight:700} .missed{color:#c62828;font-weight:700} .open{color:#8a6d00;font-weight:700}
figure{margin:1em 0} img{max-width:100%;height:auto} details{margin:1em 0} summary{cursor:pointer;color:#0b57d0}
nav ol{columns:2} a{color:#0b57d0} div.tables{display:flex;flex-wrap:wrap;gap:0 2.5em;align-items:flex-start}
div.tables p.note{flex-basis:100%;margin-top:-.6em}
"""


def headline_counts(rows: Sequence[HeadlineRow]) -> dict[str, int]:
    """How many result rows have each status and were measured by this run (``live``); checks counted apart."""
    results = [r for r in rows if r.kind == "result"]
    out = {s: sum(r.status == s for r in results) for s in STATUSES}
    out["live"] = sum(r.source == "run" for r in results)
    checks = [r for r in rows if r.kind == "check"]
    out["checks"] = len(checks)
    out["checks_failing"] = sum(r.status == "missed" for r in checks)
    return out


def _effective(r: HeadlineRow) -> str:
    """A row's status for a verdict: a stale file's recorded decision where it has one."""
    return r.recorded if r.status == "stale" and r.recorded else r.status


def _best(rows: Sequence[HeadlineRow]) -> HeadlineRow | None:
    """The row a verdict quotes: a met row with an interval, else any met row, else the first decided one."""
    picks: list[Callable[[HeadlineRow], bool]] = [
        lambda r: _effective(r) == "met" and r.ci is not None, lambda r: _effective(r) == "met",
        lambda r: _effective(r) in ("missed", "undecided") and r.ci is not None,
        lambda r: _effective(r) in ("missed", "undecided"), lambda r: True]
    for pick in picks:
        for r in rows:
            if pick(r):
                return r
    return None


def _worst(rows: Sequence[HeadlineRow]) -> HeadlineRow | None:
    """The row a verdict warns with: a missed row with an interval, else any missed row, else an undecided one."""
    for pick in (lambda r: _effective(r) == "missed" and r.ci is not None, lambda r: _effective(r) == "missed",
                 lambda r: _effective(r) == "undecided"):
        for r in rows:
            if pick(r):
                return r
    return None


def _quoted(r: HeadlineRow | None) -> dict[str, Any] | None:
    return None if r is None else {"target": r.target, "measured": r.measured.split(" [stale:")[0], "ci": r.ci,
                                   "status": _effective(r)}


def verdicts(sections: Sequence[Section]) -> list[dict[str, Any]]:
    """One verdict per axis from its result rows: ``works`` (every target met), ``partly`` (some met),
    ``not yet`` (none met), with the axis's claim (the rows its sections' ``claim`` names, and their status;
    ``None`` when no row states it), then the best (:func:`_best`) and the worst (:func:`_worst`) row, and the
    counts.

    A row read from a stale file counts with the status its recorded numbers decide (``recorded``), and the
    verdict says how many rows rest on stale files: the reader sees both the verdict and how current it is.
    """
    axes: dict[str, list[tuple[Section, HeadlineRow]]] = {}
    for s in sections:
        if s.axis:
            axes.setdefault(s.axis, []).extend((s, r) for r in s.headline if r.kind == "result")
    out = []
    for axis, pairs in axes.items():
        statuses = [_effective(r) for _, r in pairs]
        met = statuses.count("met")
        decided = len(statuses)
        verdict = "works" if decided and met == decided else "partly" if met else "not yet"
        best = _best([r for _, r in pairs])
        worst = _worst([r for _, r in pairs])
        claims = [r for s, r in pairs if any(c in r.target for c in s.claim)]
        key = next((s.key for s, r in pairs if r is (claims[0] if claims else best)), "")
        out.append({"axis": axis, "verdict": verdict, "met": met, "targets": decided,
                    "missed": statuses.count("missed"), "undecided": statuses.count("undecided"),
                    "stale_or_missing": statuses.count("stale") + statuses.count("missing"), "section": key,
                    "from_stale_files": sum(r.status == "stale" and bool(r.recorded) for _, r in pairs),
                    "claim": [_quoted(r) for r in claims] or None,
                    "best": _quoted(best), "worst": None if worst is best else _quoted(worst)})
    return out


def _quote_html(b: dict[str, Any]) -> str:
    shows = "[" in str(b["measured"])  # the measured text already gives its interval
    ci = "" if b["ci"] is None or shows else f" [{b['ci'][0]:.3g}, {b['ci'][1]:.3g}]"
    return f"{_e(b['target'])}: {_e(b['measured'] or '—')}{_e(ci)} ({_e(b['status'])})"


def _claim_html(rows: list[dict[str, Any]] | None) -> str:
    """The claim's one row, or for several (one per pattern or length) their count by status and the worst."""
    if not rows:
        return "no row states it yet"
    if len(rows) == 1:
        return _quote_html(rows[0])
    order = ("missed", "undecided", "stale", "missing", "met")
    counts = ", ".join(f"{sum(r['status'] == s for r in rows)} {s}" for s in order if any(r["status"] == s for r in rows))
    worst = min(rows, key=lambda r: order.index(r["status"]) if r["status"] in order else len(order))
    return f"{len(rows)} rows ({counts}), the worst {_quote_html(worst)}"


def _verdicts(sections: Sequence[Section]) -> str:
    items = verdicts(sections)
    if not items:
        return ""
    out = ["<ul class='verdicts' id='verdicts'>"]
    for v in items:
        cls = {"works": "met", "partly": "open", "not yet": "missed"}[v["verdict"]]
        parts = []
        if any(s.axis == v["axis"] and s.claim for s in sections):
            parts.append("claim: " + _claim_html(v["claim"]))
        if v["best"] is not None:
            parts.append(("best: " if parts else "") + _quote_html(v["best"]))
        if v["worst"] is not None:
            parts.append("worst: " + _quote_html(v["worst"]))
        stale = f", {v['stale_or_missing']} without a decision (stale or missing)" if v["stale_or_missing"] else ""
        stale += f", {v['from_stale_files']} read from stale files" if v["from_stale_files"] else ""
        out.append(f"<li><a href='#{_e(v['section'])}'><strong>{_e(v['axis'])}</strong></a>: "
                   f"<span class='{cls}'>{_e(v['verdict'])}</span> ({v['met']} of {v['targets']} targets met"
                   f"{stale}){' — ' + '; '.join(parts) if parts else ''}</li>")
    out.append("</ul>")
    return "\n".join(out)


def _checks(sections: Sequence[Section]) -> str:
    rows = [(s, r) for s in sections for r in s.headline if r.kind == "check"]
    if not rows:
        return ""
    out = ["<table class='headline' id='checks-table'><caption>Checks: properties that hold by construction (they "
           "verify the code; not results, not counted as met)</caption><thead><tr><th>technique</th><th>claim</th>"
           "<th>measured</th><th>holds because</th><th>holds</th></tr></thead><tbody>"]
    for s, r in rows:
        holds = "<span class='met'>holds</span>" if r.status == "met" else _status(r.status)
        out.append(f"<tr data-status='{_e(r.status)}'><td><a href='#{_e(s.key)}'>{_e(r.technique)}</a></td>"
                   f"<td>{_e(r.target)}</td><td>{_e(r.measured)}</td><td>{_e(r.because)}</td><td>{holds}</td></tr>")
    out.append("</tbody></table>")
    return "\n".join(out)


def headline_lede(rows: Sequence[HeadlineRow]) -> str:
    c = headline_counts(rows)
    text = f"{c['met']} met, {c['missed']} missed, {c['undecided']} undecided; {c['live']} measured in this run"
    extra = [f"{c[s]} {s}" for s in ("stale", "missing") if c[s]]
    return text + (f" ({', '.join(extra)}: see the rows for the command that regenerates them)" if extra else "")


def _headline(sections: list[Section]) -> str:
    rows = [(s, r) for s in sections for r in s.headline if r.kind == "result"]
    if not rows:
        return "<p class='lede'>No section measured a target in this run.</p>"
    out = [f"<p class='lede' id='headline-lede'><strong>{_e(headline_lede([r for _, r in rows]))}</strong>.</p>",
           "<table class='headline' id='headline-table'><thead><tr><th>technique</th><th>target</th>"
           "<th>measured</th><th>95% interval</th><th>status</th><th>source</th></tr></thead><tbody>"]
    for s, r in rows:
        src = "this run" if r.source == "run" else f"{r.artifact} @ {r.commit or 'no provenance'}"
        title = f" title='{_e(r.command)}'" if r.command else ""
        out.append(f"<tr data-source='{_e(r.source)}' data-status='{_e(r.status)}' data-ci='{_e(_ci(r))}' "
                   f"data-rate='{int(r.rate)}'><td><a href='#{_e(s.key)}'>{_e(r.technique)}</a></td>"
                   f"<td>{_e(r.target)}</td><td class='measured'>{_e(r.measured)}</td><td class='ci'>{_e(_ci(r))}</td>"
                   f"<td>{_status(r.status)}</td><td class='source'{title}>{_e(src)}</td></tr>")
    out.append("</tbody></table>")
    notes = [(s, n) for s in sections for n in s.notes]
    if notes:
        out.append("<ul class='notes' id='headline-notes'>" + "".join(
            f"<li><a href='#{_e(s.key)}'>{_e(s.title.split(':')[0])}</a>: {_e(n)}</li>" for s, n in notes) + "</ul>")
    return "\n".join(out)


def _settings(run: dict[str, Any], sections: list[Section]) -> str:
    items = [(k, v) for k, v in run.items() if not isinstance(v, (dict, list))]
    times = ", ".join(f"{s.title.split(':')[0]} {s.seconds:.0f} s" for s in sections if s.seconds is not None)
    if times:
        items.append(("wall time per section", times))
    if not items:
        return ""
    body = " · ".join(f"{_e(k if k.isupper() else k.replace('_', ' '))} <strong>{_cell(v)}</strong>"
                      for k, v in items)
    return f"<p class='settings' id='run-settings'>Run settings: {body}</p>"


def _section(s: Section) -> str:
    out = [f"<section id='{_e(s.key)}'><h2>{_e(s.title)}</h2>"]
    if s.paper:
        out.append(f"<p class='paper'>Paper: <cite>{_e(s.paper)}</cite></p>")
    if s.conclusion:
        out.append(f"<p class='conclusion'>{_e(s.conclusion)}</p>")
    if s.intro:
        out.append(f"<p class='intro'>{_e(s.intro)}</p>")
    for f in s.figures:
        _check_figure_name(s, f)
        caption = f"<strong>{_e(f.title)}.</strong> {_e(f.caption)}" if f.caption else f"<strong>{_e(f.title)}</strong>"
        out.append(f"<figure><img src='{_e(f.filename)}' alt='{_e(f.alt or f.title)}'>"
                   f"<figcaption>{caption}</figcaption></figure>")
    compact = [t for t in s.tables if len(t.rows) <= COLLAPSE_ROWS]
    full = [t for t in s.tables if len(t.rows) > COLLAPSE_ROWS] + s.details
    if compact:
        out.append("<div class='tables'>" + "\n".join(_table(t) for t in compact) + "</div>")
    if full:
        n = sum(len(t.rows) for t in full)
        out.append(f"<details><summary>Full data ({n:,} rows; also in summary.json under "
                   f"sections.{_e(s.key)})</summary>")
        out += [_table(t) for t in full]
        out.append("</details>")
    out.append("</section>")
    return "\n".join(out)


def render(sections: list[Section], title: str = "kvstate report", run: dict[str, Any] | None = None) -> str:
    """The whole page: title, headline (targets + run settings), contents, then each section."""
    keys = [s.key for s in sections]
    if len(set(keys)) != len(keys):
        raise KVStateError(f"report sections share a key: {keys}; give each section its own key.")
    toc = "".join(f"<li><a href='#{_e(s.key)}'>{_e(s.title)}</a></li>" for s in sections)
    parts = [
        "<!doctype html><html lang='en'><head><meta charset='utf-8'>",
        "<meta name='viewport' content='width=device-width, initial-scale=1'>",
        f"<meta name='generator' content='{GENERATOR}'>",
        f"<title>{_e(title)}</title><style>{_STYLE}</style></head><body>",
        f"<h1>{_e(title)}</h1>",
        "<section id='headline'><h2>Verdict per axis</h2>",
        _verdicts(sections),
        "<h2>Targets, live and recorded</h2>",
        _headline(sections),
        _checks(sections),
        _settings(run or {}, sections),
        "</section>",
        f"<nav id='contents'><h2>Contents</h2><ol>{toc}</ol></nav>",
        *(_section(s) for s in sections),
        "</body></html>",
    ]
    return "\n".join(parts)


def summary_json(sections: list[Section], run: dict[str, Any] | None = None) -> dict[str, Any]:
    """The machine-readable report: every headline row and every section's numbers (schema ``SCHEMA_VERSION``)."""
    return {
        "schema_version": SCHEMA_VERSION,
        "generator": GENERATOR,
        "run": {**(run or {}), "sections": [{"key": s.key, "title": s.title, "paper": s.paper,
                                              "seconds": s.seconds} for s in sections]},
        "verdicts": verdicts(sections),
        "headline": [_row_json(s, r) for s in sections for r in s.headline if r.kind == "result"],
        "headline_counts": headline_counts([r for s in sections for r in s.headline]),
        "checks": [_row_json(s, r) for s in sections for r in s.headline if r.kind == "check"],
        "notes": {s.key: s.notes for s in sections if s.notes},
        "sections": {s.key: s.summary for s in sections},
    }


def _row_json(s: Section, r: HeadlineRow) -> dict[str, Any]:
    d = {"section": s.key, **asdict(r)}
    if not r.timing:
        d.pop("repeats")
    return d


def write_report(out_dir: Path, sections: list[Section], run: dict[str, Any] | None = None,
                 title: str = "kvstate report") -> Path:
    """Write ``index.html`` and ``summary.json`` into ``out_dir`` (each atomically); return the page's path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for s in sections:
        for f in s.figures:
            _check_figure_name(s, f)
            if not (out_dir / f.filename).is_file():
                raise KVStateError(f"report section {s.key!r}: figure {f.filename!r} was not written to {out_dir}; "
                                   "save it there before returning the Section.")
    page = render(sections, title, run)
    summary = json.dumps(_finite(summary_json(sections, run)), indent=2, sort_keys=True, allow_nan=False)
    index = out_dir / "index.html"
    write_text_atomic(out_dir / "summary.json", summary + "\n")
    write_text_atomic(index, page)
    return index


def _finite(value: Any) -> Any:
    """JSON-ready copy: numpy / torch scalars and arrays to Python, NaN and infinities to null (strict JSON)."""
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):  # numpy / torch scalars and arrays
        return _finite(value.tolist())
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    raise KVStateError(f"summary.json: a {type(value).__name__} is not JSON-serialisable; convert it in the section.")
