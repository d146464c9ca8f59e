"""The report as a reader sees it: rendered in headless Chromium, and its headline numbers traced to summary.json.

Builds a small report once (the model-state and prefix-caching sections, which run in seconds, plus a
synthetic section with an annotated heatmap and a collapsed table) through the same builder as
``kvstate report``.
"""

from __future__ import annotations

import json
import math
import re
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from kvstate.lab.make import build as build_mod
from kvstate.lab.prefix import section as prefix_section
from kvstate.lab.report import plots
from kvstate.lab.report.browser import INSTALL_HINT, check_page, find_chromium
from kvstate.lab.report.html import COLLAPSE_ROWS, Figure, Section, Table, headline_lede, run_row

NUMBER = re.compile(r"(?<![\w.])([-+]?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?)(?![\w])(%?)")


def _synthetic(out_dir: Path, models_dir: Path) -> Section:
    fig, axes = plots.figure(0.5, 3)
    values = [[0.5, 0.75], [1.0, None]]
    assert plots.heatmap(axes[0][0], values, ["256", "512"], ["0%", "50%"], "context length (tokens)", "depth")
    name = plots.save(fig, out_dir, "synthetic_heatmap.png")
    return Section("synthetic", "Synthetic: a section written against the interface", paper="No Paper",
                   conclusion="Half of the cells scored 0.75 or more.", figures=[Figure("Heatmap", name)],
                   tables=[Table("long", ["i"], [[i] for i in range(COLLAPSE_ROWS + 2)])],
                   headline=[run_row("synthetic", "mean score >= 0.70", "0.75 (n = 3)", status="undecided",
                                     ci=(0.30, 0.95), rate=True)],
                   summary={"mean": 0.75, "n": 3, "cells": values})


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("page") / "report"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(prefix_section, "N_REQUESTS", 100)  # the same code on less data: seconds, not a minute
        mp.setattr(prefix_section, "TIMING_TOKENS", 512)
        mp.setattr(prefix_section, "TIMING_REPEATS", 5)  # a timing row needs >= 5 rounds
        mp.setattr(build_mod, "SECTIONS", [s for s in build_mod.SECTIONS if s[0] in ("model state", "prefix caching")]
                   + [("synthetic", _synthetic)])
        build_mod.build_report(out, out.parent / "no-models")
    return out


class _Headline(HTMLParser):
    """Cells of the rows of the page's headline table."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[list[str]] = []
        self._in_table = self._in_cell = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "table" and ("id", "headline-table") in attrs:
            self._in_table = True
        elif self._in_table and tag == "tr" and (not self.rows or self.rows[-1]):
            self.rows.append([])
        elif self._in_table and tag == "td":
            self._in_cell = True
            self.rows[-1].append("")

    def handle_endtag(self, tag: str) -> None:
        if tag == "table" and self._in_table:
            self._in_table = False
            self.rows = [r for r in self.rows if r]
        elif tag == "td":
            self._in_cell = False

    def handle_data(self, data: str) -> None:
        if self._in_cell:
            self.rows[-1][-1] += data


def _numbers(value: Any) -> list[float]:
    if isinstance(value, bool):
        return []
    if isinstance(value, (int, float)):
        return [float(value)]
    if isinstance(value, dict):
        return [x for v in value.values() for x in _numbers(v)]
    if isinstance(value, list):
        return [x for v in value for x in _numbers(v)]
    return []


def untraced_numbers(measured: str, data: Any) -> list[str]:
    """Numbers shown in ``measured`` that no number in ``data`` rounds to (as a share when followed by %)."""
    candidates = _numbers(data)
    missing = []
    for token, percent in NUMBER.findall(measured):
        text = token.replace(",", "")
        mantissa, _, exponent = text.lower().partition("e")
        decimals = len(mantissa.partition(".")[2])
        tol = 0.5 * 10.0 ** (int(exponent or 0) - decimals) * (1 + 1e-9)
        x = float(text)
        scales = (100.0,) if percent else (1.0,)
        if not any(math.isfinite(v) and abs(v * s - x) <= tol for v in candidates for s in scales):
            missing.append(token + percent)
    return missing


def test_every_headline_number_is_in_summary_json(report):
    summary = json.loads((report / "summary.json").read_text())
    parser = _Headline()
    parser.feed((report / "index.html").read_text())
    assert len(parser.rows) == len(summary["headline"]) >= 4
    assert len(summary["checks"]) >= 4  # rows that hold by construction are apart, not in the headline table
    for cells, row in zip(parser.rows, summary["headline"], strict=True):
        technique, target, measured = (c.strip() for c in cells[:3])
        assert (technique, target, measured) == (row["technique"], row["target"], row["measured"])
        assert NUMBER.search(measured)
        assert untraced_numbers(measured, summary["sections"][row["section"]]) == [], (measured, row["section"])


def test_every_headline_row_has_source_ci_and_status(report):
    """source says live or recorded; a rate shows its interval; status is met / missed / undecided / stale / missing."""
    summary = json.loads((report / "summary.json").read_text())
    parser = _Headline()
    page = (report / "index.html").read_text()
    parser.feed(page)
    assert len(parser.rows) == len(summary["headline"])
    for cells, row in zip(parser.rows, summary["headline"], strict=True):
        _, _, _, ci, status, source = (c.strip() for c in cells)
        assert status == row["status"] and status in ("met", "missed", "undecided", "stale", "missing")
        assert row["source"] in ("run", "artifact")
        if row["source"] == "run":
            assert source == "this run"
        else:
            assert source.startswith(row["artifact"]) and row["command"]
        if row["rate"] and status not in ("stale", "missing"):
            lo, hi = row["ci"]
            assert lo <= hi and ci == f"[{lo:.3g}, {hi:.3g}]"
        if row["status"] in ("met", "missed") and row["ci"] is not None:  # a decided rate: its interval is on one side
            assert row["met"] is (row["status"] == "met")
    assert any(r["rate"] for r in summary["headline"])  # the synthetic rate row
    counts = summary["headline_counts"]
    assert counts["live"] == sum(r["source"] == "run" for r in summary["headline"])
    assert headline_lede([run_row("x", "t", "1", True)]) == "1 met, 0 missed, 0 undecided; 1 measured in this run"
    assert f"{counts['met']} met, {counts['missed']} missed, {counts['undecided']} undecided; {counts['live']} measured in this run" in page


def test_the_number_check_catches_a_number_not_in_the_data():
    assert untraced_numbers("1.04× and 3.2% (n = 20)", {"a": 1.0431, "b": [0.0318], "n": 20}) == []
    assert untraced_numbers("1.05×", {"a": 1.0431}) == ["1.05"]
    assert untraced_numbers("3.2%", {"b": 3.2}) == ["3.2%"]  # a share is shown ×100
    assert untraced_numbers("2.9e-06 fp32; bf16 ok", {"d": 2.94e-6}) == []
    assert untraced_numbers("9 of 9", {"models": 9, "exact": 8}) == []  # each number found somewhere
    assert untraced_numbers("7 of 9", {"models": 9, "exact": 8}) == ["7"]


def test_report_renders_in_chromium(report, tmp_path):
    if find_chromium() is None:
        pytest.fail(f"the report's browser test needs Chromium; {INSTALL_HINT}.")
    page = check_page(report / "index.html", width=1400, screenshot=tmp_path / "first_screen.png")
    summary = json.loads((report / "summary.json").read_text())
    assert page.title == "kvstate report"
    assert page.errors == []
    assert len(page.images) >= 4 and page.broken_images == []
    assert {i["src"] for i in page.images} == {p.name for p in report.glob("*.png")}
    assert page.missing_anchors == []
    assert len(page.headline) == len(summary["headline"])
    assert all(len(row) == 6 and row[2] and row[4] in ("met", "missed", "undecided", "stale", "missing")
               and row[5] for row in page.headline)
    assert (tmp_path / "first_screen.png").stat().st_size > 10_000
    narrow = check_page(report / "index.html", width=1280)
    assert 0 < narrow.scroll_width <= 1280  # no horizontal scrolling at 1,280 px
    assert [v["axis"] for v in summary["verdicts"]] == ["position"] and "id='verdicts'" in (report / "index.html").read_text()


def test_the_browser_check_sees_broken_images_and_errors(report, tmp_path):
    if find_chromium() is None:
        pytest.fail(f"the report's browser test needs Chromium; {INSTALL_HINT}.")
    bad = tmp_path / "bad.html"
    bad.write_text((report / "index.html").read_text().replace(
        "</body>", "<img src='absent.png'><a href='#nowhere'>x</a><script>console.error('boom')</script></body>"))
    for png in report.glob("*.png"):
        (tmp_path / png.name).write_bytes(png.read_bytes())
    page = check_page(bad)
    assert page.broken_images == ["absent.png"] and page.missing_anchors == ["nowhere"]
    assert any("boom" in e for e in page.errors) and any("absent.png" in e for e in page.errors)
