"""``kvstate lab retrain MODEL``: replay the recorded commands of every training part of a committed model.

``kvstate train`` and ``kvstate depth train`` record each part's exact command line, output directory,
start directory and first step in ``training_state.json`` (``commands``). Retraining replays them in
order into a scratch directory (``runs/retrain/<name>/`` by default, never the committed model): the
original output path in each command is replaced by the scratch one, so a resumed part resumes the
replayed run. A run whose first recorded part did not start from step 0 of a fresh model nor from
another committed model (parts trained before commands were recorded) cannot be replayed exactly;
that is refused with the reason. Replays take as long as the original parts (hours for the reference
models on 2 cores); each part is itself resumable. Each part runs in its own process group
(:mod:`kvstate.lab.child`): a SIGINT or SIGTERM to the replay stops the part's processes too.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from kvstate.errors import KVStateError
from kvstate.lab.child import run_job
from kvstate.lab.provenance import REPO


@dataclass(frozen=True)
class Part:
    command: str  # the command as it was run
    replay: str  # the command with the output directory replaced by the scratch one
    from_step: int


def plan(model_dir: str | Path, scratch: str | Path | None = None) -> list[Part]:
    """The replay of ``model_dir``'s recorded training parts; raises when it cannot be replayed exactly."""
    d = Path(model_dir)
    state_path = d / "training_state.json"
    if not state_path.is_file():
        raise KVStateError(f"{d}: no training_state.json; kvstate lab retrain replays models trained by kvstate train "
                           "or kvstate depth train")
    try:
        state = json.loads(state_path.read_text())
    except json.JSONDecodeError:
        raise KVStateError(f"{state_path} is not JSON; restore it from git (git checkout -- {state_path})") from None
    commands = state.get("commands") or []
    if not commands:
        raise KVStateError(f"{d} was trained before training commands were recorded (step {state.get('step')}); "
                           f"its card ({d / 'README.md'}) describes the parts, which cannot be replayed exactly")
    first = commands[0]
    start = first.get("resume")
    fresh = first["from_step"] == 0 and start is None
    from_model = start is not None and Path(start).resolve() != Path(first["out"]).resolve() \
        and (REPO / start / "training_state.json").is_file()
    if not (fresh or from_model):
        raise KVStateError(f"{d}: its first recorded part starts at step {first['from_step']} from {start!r}, not from "
                           "a fresh model or another committed model; the earlier parts were not recorded")
    target = Path(scratch) if scratch is not None else REPO / "runs" / "retrain" / d.name
    outs = {c["out"] for c in commands}
    parts = []
    for c in commands:
        argv = shlex.split(c["command"])
        argv = [str(target) if a in outs else a for a in argv]
        parts.append(Part(c["command"], shlex.join(argv), int(c["from_step"])))
    return parts


def retrain(model_dir: str | Path, *, scratch: str | Path | None = None, dry_run: bool = False,
            console: Console | None = None) -> list[Part]:
    """Print the plan, then (unless ``dry_run``) run each part in order; stops at the first failure."""
    con = console or Console(stderr=True)
    parts = plan(model_dir, scratch)
    state = json.loads((Path(model_dir) / "training_state.json").read_text())
    con.print(f"retrain {model_dir}: {len(parts)} part(s); the original took {state.get('seconds', 0) / 3600:.1f} h "
              "of training (resumable part by part)")
    for i, p in enumerate(parts, 1):
        con.print(f"  {i}. {p.replay}")
    if dry_run:
        return parts
    env = {**os.environ, "PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")}
    for i, p in enumerate(parts, 1):
        con.print(f"part {i}/{len(parts)}: {p.replay}")
        code = run_job(p.replay, cwd=REPO, env=env)
        if code != 0:
            raise KVStateError(f"retrain {model_dir}: part {i} failed (exit {code}); fix it and run the "
                               f"same command with --resume, or kvstate lab retrain again")
    return parts


__all__ = ["Part", "plan", "retrain"]
