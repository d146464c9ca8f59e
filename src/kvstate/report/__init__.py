"""kvstate.report — the HTML report (headline, figures, tables) and summary.json written by ``kvstate report``."""

from kvstate.report.build import SECTIONS, build_report, is_report_dir
from kvstate.report.html import (
    SCHEMA_VERSION,
    Figure,
    HeadlineRow,
    Section,
    Table,
    atomic_write_text,
    pct,
    pivot,
    write_report,
)

__all__ = ["SCHEMA_VERSION", "SECTIONS", "Figure", "HeadlineRow", "Section", "Table", "atomic_write_text",
           "build_report", "is_report_dir", "pct", "pivot", "write_report"]
