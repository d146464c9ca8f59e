"""``make reproduce``: regenerate every committed result file the report reads (never the trained weights).

Each job is one command that appends a run, with its provenance, to one result file
(:mod:`kvstate.lab.provenance`). The runner is resumable: a job whose result file is already
``current`` (its code and models unchanged since its newest run) is skipped, so an interrupted
``make reproduce`` continues where it stopped; the long SEKV and transfer jobs also resume inside
themselves, from the units their journal recorded (:mod:`kvstate.lab.journal`). Before starting it prints the plan with an estimate per
job — the wall time recorded by the file's newest run where there is one, else the job's rough estimate
(from a partial run here where one was made) — and shows a progress bar over the jobs while they run (each job's own output goes to
its log under ``runs/reproduce/``). Each job runs in its own process group (:mod:`kvstate.lab.child`): a SIGINT or
SIGTERM to the runner stops the job's processes too before the runner exits with 130.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvstate.errors import KVStateError
from kvstate.lab.child import run_job
from kvstate.lab.provenance import REPO, load_artifact

if TYPE_CHECKING:
    from kvstate.lab.transfer.section import Pair


@dataclass(frozen=True)
class Job:
    name: str  # short id, e.g. "depth:ref-attn-rcla"
    artifact: str  # repository-relative result file the command appends to
    command: str  # shell command, run from the repository root
    estimate_s: float  # rough wall seconds (2-core machine, one thread) used until a run is recorded
    select: Callable[[dict[str, Any]], bool] | None = None  # which run of a shared file is this job's (default newest)


def _depth(name: str) -> Job:
    from kvstate.lab.depth.section import EVAL_FILE, eval_command

    return Job(f"depth:{name}", f"models/{name}/{EVAL_FILE}", eval_command(name), 900.0)


def _depth_decode(name: str) -> Job:
    from kvstate.lab.depth.section import DECODE_FILE, decode_command

    return Job(f"depth:decode-{name}", f"models/{name}/{DECODE_FILE}", decode_command(name), 300.0)


def jobs() -> list[Job]:
    """Every result file the report reads, with the command that regenerates it."""
    from kvstate.lab.depth.section import KV1, LABELS, RCLA
    from kvstate.lab.prefix.replay_section import REPLAY_CMD, REPLAY_FILE, TREE_CMD, TREE_FILE
    from kvstate.lab.report import eval_section
    from kvstate.lab.semantic.section import (
        BOUNDS_COMMAND,
        DECODE_COMMAND,
        EVAL_COMMAND,
        FOUR_COMMAND,
        HYBRID_COMMAND,
        MEMORY_COMMAND,
        SWEEP_COMMAND,
    )
    from kvstate.lab.transfer.section import BENCH_FILE, NEAR_ALIGNED, PAIRS, TTFT_FILE

    return [
        # the reference models' full-cache scores (sweep + gate, one thread): ~5 min a model on a quiet machine
        *(Job(f"reference:{d.name}", f"models/{d.name}/{eval_section.RESULT_FILE}",
              eval_section.command(d.relative_to(REPO)), 300.0)
          for d in eval_section.reference_dirs(REPO / "models")),
        Job("prefix:replay", f"models/ref-hybrid/{REPLAY_FILE}", REPLAY_CMD, 1500.0),
        Job("prefix:tree-replay", f"models/ref-hybrid/{TREE_FILE}", TREE_CMD, 1800.0),
        *(_depth(name) for name in LABELS),
        *(_depth_decode(name) for name in (RCLA, KV1)),
        # the SEKV grid (4:1 and 8:1 at 2K, 3 needle tasks x 100 items, 8 methods + 2 presses), timed here at seed
        # 1021 with the other core busy: ~16 min in-process, ~15 min for the presses
        Job("semantic:ref-attn", "models/ref-attn-sekv/eval.json", EVAL_COMMAND, 1900.0),
        Job("semantic:bounds", "models/ref-attn-sekv/eval_bounds.json", BOUNDS_COMMAND, 450.0),  # 8:1, memory 0.30
        Job("semantic:4x", "models/ref-attn-sekv/eval_4x.json", FOUR_COMMAND, 400.0),
        Job("semantic:16x", "models/ref-attn-sekv/eval_16x.json", MEMORY_COMMAND, 1200.0),  # 4K, presses included
        Job("semantic:sweep", "models/ref-attn-sekv/eval_sweep.json", SWEEP_COMMAND, 450.0),  # perplexity
        Job("semantic:decode", "models/ref-attn-sekv/decode.json", DECODE_COMMAND, 300.0),  # interleaved repeats
        Job("semantic:ref-hybrid", "models/ref-hybrid-sekv/eval.json", HYBRID_COMMAND, 1100.0),
        *(job for pair in PAIRS if pair == NEAR_ALIGNED or (REPO / "models" / pair.codec).is_dir()
          for job in _transfer(pair, BENCH_FILE, TTFT_FILE)),
    ]


def _transfer(pair: Pair, bench_file: str, ttft_file: str) -> list[Job]:
    """A pair's bench and TTFT jobs (a pair whose codec is not trained yet has none; the near-aligned pair always)."""
    from kvstate.lab.transfer.section import options_run, scd_run

    suffix = "" if pair.label == "near-aligned" else f"-{pair.label}"
    return [
        # a partial run here: 141 of 1,421 items in 459 s with the other core busy
        Job(f"transfer:bench{suffix}", f"models/{pair.codec}/{bench_file}", pair.bench_command(), 4700.0,
            select=scd_run),
        # shaped links need root (a network namespace); 3 rates x 1K / 4K / 8K x 5 repeats x 7 methods + oracle,
        # cold and warm: estimated from a 1-rate 1K 3-repeat run here (2 min), prefill growing with length
        Job(f"transfer:ttft{suffix}", f"models/{pair.codec}/{ttft_file}", pair.ttft_command(), 2400.0),
        # the selective-recompute quality run: ~12-21 min here (seeds 1007 / 1010)
        Job(f"transfer:options{suffix}", f"models/{pair.codec}/{bench_file}", pair.options_command(), 1260.0,
            select=options_run),
    ]


def _estimate(job: Job) -> tuple[str, float]:
    art = load_artifact(REPO / job.artifact, job.command, select=job.select)
    recorded = art.provenance.get("wall_seconds") if art.run is not None else None
    return art.status, float(recorded) if isinstance(recorded, (int, float)) else job.estimate_s


def _journaled(job: Job) -> int:
    """Units an interrupted run of ``job`` already journaled (:mod:`kvstate.lab.journal`); 0 if none."""
    from kvstate.lab.journal import journal_path

    path = journal_path(REPO / job.artifact)
    if not path.is_file():
        return 0
    with path.open(encoding="utf-8", errors="replace") as f:
        return max(0, sum(1 for _ in f) - 1)  # the first line is the run's identity


def _fmt(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.0f} min"


def reproduce(only: Sequence[str] = (), *, dry_run: bool = False, force: bool = False,
              console: Console | None = None) -> list[tuple[str, str]]:
    """Run the stale / missing jobs (all chosen ones with ``force``); returns ``(job, outcome)`` pairs."""
    con = console or Console(stderr=True)
    chosen = [j for j in jobs() if not only or j.name in only or j.name.split(":")[0] in only]
    unknown = set(only) - {j.name for j in jobs()} - {j.name.split(":")[0] for j in jobs()}
    if unknown:
        raise KVStateError(f"--only {', '.join(sorted(unknown))}: no such job; choose from "
                           f"{', '.join(j.name for j in jobs())} or an axis (reference, prefix, depth, semantic, transfer)")
    plan = []
    table = Table(title="make reproduce: result files the report reads")
    for col in ("job", "result file", "status", "estimate", "action"):
        table.add_column(col)
    for j in chosen:
        status, est = _estimate(j)
        run = force or status != "current"
        plan.append((j, run, est))
        done = _journaled(j)
        action = (f"resume ({done} units journaled)" if done else "run") if run else \
            "skip (current)"
        table.add_row(j.name, j.artifact, status, _fmt(est), action)
    con.print(table)
    total = sum(est for _, run, est in plan if run)
    con.print(f"estimated wall time for the jobs to run: {_fmt(total)} (resumable: a finished job is skipped "
              "next time)")
    if dry_run:
        return [(j.name, "planned" if run else "current") for j, run, _ in plan]
    logs = REPO / "runs" / "reproduce"
    logs.mkdir(parents=True, exist_ok=True)
    outcomes: list[tuple[str, str]] = []
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    bin_dir = str(Path(sys.executable).parent)
    env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed:.0f}/{task.total:.0f} s"),
                  TimeElapsedColumn(), console=con) as progress:
        bar = progress.add_task("reproduce", total=max(total, 1.0))
        for j, run, est in plan:
            if not run:
                outcomes.append((j.name, "current"))
                continue
            progress.update(bar, description=f"{j.name}")
            log = logs / f"{j.name.replace(':', '_')}.log"
            t0 = time.perf_counter()
            with log.open("a") as f:  # appended: an interrupted job's earlier parts stay in its log
                f.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {j.command}\n")
                f.flush()
                cmd = j.command.replace("python ", f"{shlex.quote(sys.executable)} ", 1) \
                    if j.command.split()[0] in ("python", "OMP_NUM_THREADS=1") else j.command
                code = run_job(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)
            outcomes.append((j.name, "done" if code == 0 else f"failed (exit {code}; see {log})"))
            progress.update(bar, advance=est)
            con.print(f"{j.name}: {outcomes[-1][1]} in {_fmt(time.perf_counter() - t0)}")
    failed = [name for name, o in outcomes if o.startswith("failed")]
    if failed:
        raise KVStateError(f"make reproduce: {', '.join(failed)} failed; see runs/reproduce/*.log, fix, and run "
                           "make reproduce again (finished jobs are skipped)")
    return outcomes


__all__ = ["Job", "jobs", "reproduce"]
