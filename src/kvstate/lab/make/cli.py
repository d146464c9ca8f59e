"""``kvstate lab ...``: regenerate the committed results the report reads, replay a model's training.

A typer sub-app registered by ``cli.py``; the work is in :mod:`kvstate.lab.make.reproduce` and
:mod:`kvstate.lab.training.retrain`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="The lab: regenerate committed results (reproduce), replay a model's training (retrain).")


@app.command("reproduce")
def reproduce_command(
    only: Annotated[list[str] | None, typer.Option(
        "--only", help="Jobs (e.g. depth:ref-attn-rcla,transfer:ttft) or axes; comma-separated or repeated.")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the plan and the estimate only.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Also rerun jobs whose result file is current.")] = False,
) -> None:
    """Regenerate every stale or missing result file the report reads (resumable; prints an estimate first)."""
    from kvstate.lab.lists import parse_names
    from kvstate.lab.make.reproduce import reproduce

    names = [name for value in only or () for name in parse_names(value, "--only", example="semantic:sweep,transfer")]
    reproduce(names, dry_run=dry_run, force=force)


@app.command("retrain")
def retrain_command(
    model: Annotated[Path, typer.Argument(help="A committed model directory, e.g. models/ref-attn-rcla.")],
    scratch: Annotated[Path | None, typer.Option("--scratch", help="Where to train (default runs/retrain/NAME).")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the recorded parts only.")] = False,
) -> None:
    """Replay the recorded training commands of MODEL into a scratch directory (may take hours)."""
    from kvstate.lab.training.retrain import retrain

    retrain(model, scratch=scratch, dry_run=dry_run)
