"""kvstate.report — the HTML report (tables + plots) and summary.json written by ``kvstate report``."""

from kvstate.report.build import SECTIONS, build_report
from kvstate.report.html import Figure, Section, Table, atomic_write_text, write_report

__all__ = ["SECTIONS", "Figure", "Section", "Table", "atomic_write_text", "build_report", "write_report"]
