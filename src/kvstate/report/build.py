"""The main job: run every technique's report section on the embedded default models.

``kvstate report --out DIR`` writes ``DIR/index.html`` (tables + PNG plots) and ``DIR/summary.json``.
Sections register here as their techniques land.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from kvstate.report import eval_section, model_state, prefix_section, transfer_section
from kvstate.report.html import Section, write_report

SectionBuilder = Callable[[Path, Path], Section]

SECTIONS: list[tuple[str, SectionBuilder]] = [
    ("model state", model_state.build),
    ("prefix caching", prefix_section.build),
    ("reference models", eval_section.build),
    ("across models", transfer_section.build),
]


def build_report(out_dir: Path, models_dir: Path = Path("models"), only: list[str] | None = None) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    chosen = [(n, b) for n, b in SECTIONS if only is None or n in only]
    sections: list[Section] = []
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn()) as progress:
        task = progress.add_task("report", total=len(chosen))
        for name, builder in chosen:
            progress.update(task, description=f"section: {name}")
            sections.append(builder(out_dir, models_dir))
            progress.advance(task)
    return write_report(out_dir, sections)
