"""kvstate.lab.report — the HTML report (headline, figures, tables) and summary.json written by ``kvstate report``.

The builder (:mod:`kvstate.lab.make.build`) is imported on its own: it imports every section, and
sections import this package's page types."""

from kvstate.lab.report.html import (
    SCHEMA_VERSION,
    Figure,
    HeadlineRow,
    Section,
    Table,
    pct,
    pivot,
    write_report,
)

__all__ = ["SCHEMA_VERSION", "Figure", "HeadlineRow", "Section", "Table", "pct", "pivot", "write_report"]
