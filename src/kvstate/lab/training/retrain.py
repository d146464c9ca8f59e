"""``kvstate lab retrain MODEL``: replay the recorded commands of every training part of a committed model.

``kvstate train`` and ``kvstate depth train`` record each part's exact command line, output directory,
start directory and first step in ``training_state.json`` (``commands``). Retraining replays them in
order into a scratch directory (``runs/retrain/<name>/`` by default, never the committed model): each
recorded output directory in a command is replaced by its own scratch folder (the scratch directory
itself when every part wrote one directory and none was stopped early), so a resumed part resumes the
replayed part it resumed. A part that was stopped early (interrupted) and resumed from its periodic saves
(``.<out>.partial``, where the next part starts) is replayed with ``--stop-at-step`` at the step the next part
started from, so the replay stops where the original did, with the same periodic save to resume.
The plan reads only the first part's start (a fresh model, or another committed model) and what earlier
replayed parts wrote, and writes only inside the scratch directory: a run whose first recorded part did
not start from step 0 of a fresh model nor from another committed model (parts trained before commands
were recorded), a later part that resumed a directory no recorded part wrote (an intermediate copied by
hand), or a command whose ``--out`` is not its recorded output directory is refused with one line naming
the path. Ignored: other paths a command reads (``--init-from``). Replays take as long as the original parts (hours for the reference
models on 2 cores); each part is itself resumable. Each part runs in its own process group
(:mod:`kvstate.lab.child`): a SIGINT or SIGTERM to the replay stops the part's processes too.
"""

from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from kvstate.errors import KVStateError
from kvstate.lab.child import run_job
from kvstate.lab.provenance import REPO
from kvstate.lab.training.io import STATE_FILE, partial_dir, read_state


@dataclass(frozen=True)
class Part:
    command: str  # the command as it was run
    replay: str  # the command with every recorded output directory replaced by its scratch one
    from_step: int
    out: Path  # where the replay writes (inside the scratch folder)
    stop_at_step: int | None = None  # the step the part was stopped at (the next part resumed its periodic save)


def _norm(path: str) -> str:
    return os.path.normpath(path)


def _swap(arg: str, where: dict[str, Path]) -> str:
    """``arg`` with a recorded output directory (alone or as ``--option=DIR``) replaced by its scratch one."""
    if _norm(arg) in where:
        return str(where[_norm(arg)])
    key, eq, value = arg.partition("=")
    return f"{key}={where[_norm(value)]}" if arg.startswith("--") and eq and _norm(value) in where else arg


def _option(argv: list[str], name: str) -> str | None:
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def _inside(path: Path, folder: Path) -> bool:
    return path.resolve() == folder.resolve() or folder.resolve() in path.resolve().parents


def plan(model_dir: str | Path, scratch: str | Path | None = None) -> list[Part]:
    """The replay of ``model_dir``'s recorded training parts; raises when it cannot be replayed exactly, or
    when it would read or write outside the scratch folder."""
    d = Path(model_dir)
    state_path = d / STATE_FILE
    if not state_path.is_file():
        raise KVStateError(f"{d}: no training_state.json; kvstate lab retrain replays models trained by kvstate train "
                           "or kvstate depth train")
    state = read_state(state_path, ("commands[].command", "commands[].out", "commands[].from_step"))
    commands = state.get("commands") or []
    if not commands:
        raise KVStateError(f"{d} was trained before training commands were recorded (step {state.get('step')}); "
                           f"its card ({d / 'README.md'}) describes the parts, which cannot be replayed exactly")
    first = commands[0]
    start = first.get("resume")
    fresh = first["from_step"] == 0 and start is None
    from_model = start is not None and Path(start).resolve() != Path(first["out"]).resolve() \
        and (REPO / start / STATE_FILE).is_file()
    if not (fresh or from_model):
        raise KVStateError(f"{d}: its first recorded part starts at step {first['from_step']} from {start!r}, not from "
                           "a fresh model or another committed model; the earlier parts were not recorded")
    target = Path(scratch) if scratch is not None else REPO / "runs" / "retrain" / d.name
    if _inside(target, d) or _inside(d, target):
        raise KVStateError(f"--scratch {target}: overlaps the committed model {d}; pass a folder outside it")
    # each recorded output directory gets its own scratch folder, so a part that resumed another part's output
    # (a new run) stays a new run, and one that resumed its own output (the same run) stays the same run
    outs = list(dict.fromkeys(_norm(c["out"]) for c in commands))
    saves = {_norm(str(partial_dir(Path(o)))): o for o in outs}  # each output's periodic saves -> the output
    # a part stopped early: a later part resumed its periodic saves, at the step the replay must stop at
    stops: dict[int, int] = {}
    for j, c in enumerate(commands[1:], 1):
        src = saves.get(_norm(c.get("resume") or ""))
        earlier = [k for k in range(j) if _norm(commands[k]["out"]) == src]
        if earlier:
            stops[earlier[-1]] = int(c["from_step"])
    names = [Path(o).name for o in outs]
    where = {o: target if len(outs) == 1 and not stops else target / (n if names.count(n) == 1 else f"{i}-{n}")
             for i, (o, n) in enumerate(zip(outs, names, strict=True), 1)}
    where.update({p: partial_dir(where[o]) for p, o in saves.items()})  # a --resume naming periodic saves
    parts, written = [], set()
    for i, c in enumerate(commands, 1):
        resume = c.get("resume")
        if i > 1 and resume is not None and _norm(resume) not in written:
            raise KVStateError(f"{d}: part {i} resumes from {resume}, which no earlier recorded part wrote; replaying "
                               f"it would read outside the scratch folder {target}, so the run cannot be replayed "
                               f"exactly (its card, {d / 'README.md'}, says how that directory was made)")
        argv = [_swap(a, where) for a in shlex.split(c["command"])]
        out = _option(argv, "--out")
        if out is None or not _inside(Path(out), target):
            raise KVStateError(f"{d}: part {i} would write {out or '(no --out)'}, outside the scratch folder {target}; "
                               "its recorded command does not name its recorded output directory")
        stop = stops.get(i - 1)
        save = _norm(str(partial_dir(Path(c["out"]))))
        if stop is not None:  # it ends with its periodic save at that step; its output is not written
            if stop <= int(c["from_step"]):
                raise KVStateError(f"{d}: part {i + 1} resumes the periodic save of part {i} at step {stop}, not after "
                                   f"part {i}'s first step {c['from_step']}; the recorded parts are inconsistent")
            argv += ["--stop-at-step", str(stop)]
            written.add(save)
        else:  # it ran to its end: its output written, its periodic saves dropped
            written.add(_norm(c["out"]))
            written.discard(save)
        parts.append(Part(c["command"], shlex.join(argv), int(c["from_step"]), Path(out), stop))
    return parts


def retrain(model_dir: str | Path, *, scratch: str | Path | None = None, dry_run: bool = False,
            console: Console | None = None) -> list[Part]:
    """Print the plan, then (unless ``dry_run``) run each part in order; stops at the first failure."""
    con = console or Console(stderr=True)
    parts = plan(model_dir, scratch)
    state = read_state(Path(model_dir) / STATE_FILE, ("seconds",))
    con.print(f"retrain {model_dir}: {len(parts)} part(s); the original took {state.get('seconds', 0) / 3600:.1f} h "
              "of training (resumable part by part)")
    for i, p in enumerate(parts, 1):
        con.print(f"  {i}. {p.replay}")
    con.print(f"the replayed model: {parts[-1].out}")
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
