"""``kvstate train`` and ``kvstate eval``: the reference-model commands, registered by ``cli.py``.

Plain functions with ``typing.Annotated`` typer parameters, so ``cli.py`` registers them with
``app.command("train")(train_command)`` and tests can call them directly. They parse arguments, call
:func:`kvstate.lab.training.train.train` / :func:`kvstate.lab.harness.run_tasks` and print; bad input raises a
:class:`~kvstate.errors.KVStateError` (the CLI's ``main`` turns it into exit code 2).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated

import typer

from kvstate.errors import KVStateError


def _passive_openmp() -> None:
    # Before torch loads: spinning OpenMP workers stall 5-20x per step when another process shares the
    # 2 cores (measured here: 0.3 s -> 6 s per step); passive waiting costs little on an idle machine.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def parse_overrides(items: list[str]) -> dict[str, object]:
    """``["max_length=2048", "task_mix={\"niah_single\": 1}"]`` -> TrainConfig keyword arguments."""
    from dataclasses import fields

    from kvstate.lab.training.train import TrainConfig

    names = {f.name for f in fields(TrainConfig)} - {"arch", "minutes", "seed"}
    out: dict[str, object] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if key.strip() in ("arch", "minutes", "seed"):
            raise KVStateError(f"--set {item!r}: {key.strip()} has its own option; pass --{key.strip()} instead")
        if not sep or key.strip() not in names:
            raise KVStateError(f"--set {item!r}: expected FIELD=VALUE with FIELD one of {', '.join(sorted(names))}")
        if key.strip() in out:
            raise KVStateError(f"--set {key.strip()} given twice; pass each field once")
        try:
            out[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            out[key.strip()] = raw  # a bare string such as advance_metric=exact
        except RecursionError:
            raise KVStateError(f"--set {key.strip()}: value nested too deeply; pass a plain JSON value") from None
    return out


def train_command(
    arch: Annotated[str, typer.Option("--arch", help="attn (Qwen3) or hybrid (Qwen3.5: 3 Gated DeltaNet : 1 attention).")],
    out: Annotated[Path, typer.Option("--out", help="Directory to save the model, tokenizer and training state.")],
    minutes: Annotated[float, typer.Option("--minutes", help="Wall-clock training budget of this run.")] = 30.0,
    seed: Annotated[int, typer.Option("--seed", min=0, help="Seed of the initialisation and the data stream.")] = 0,
    resume: Annotated[Path | None, typer.Option(
        "--resume", help="Continue a run saved in this directory (an unfinished run's periodic saves: .DIR.partial).")] = None,
    init_from: Annotated[Path | None, typer.Option(
        "--init-from", help="Start a new model from a trained one's matching tensors (e.g. hybrid from ref-attn).")] = None,
    overrides: Annotated[list[str] | None, typer.Option(
        "--set", help="Override a TrainConfig field, e.g. --set max_length=2048 --set threads=1 (JSON values).")] = None,
    overwrite: Annotated[bool, typer.Option(
        "--overwrite", help="Replace an --out directory that already holds files (replaced whole when the run ends).")] = False,
    stop_at_step: Annotated[int | None, typer.Option(
        "--stop-at-step", min=0, help="Stop after this step with the periodic save written and --out not, as an "
        "interrupted part (kvstate lab retrain replays a part that was stopped early and resumed).")] = None,
) -> None:
    """Train a reference model on the synthetic tasks with a context-length curriculum (CPU, bf16 autocast)."""
    _passive_openmp()
    from rich.console import Console

    from kvstate.lab.training.train import PartStopped, TrainConfig, train

    if resume is not None and init_from is not None:
        raise KVStateError("--resume and --init-from exclude each other: a resumed run keeps its own weights")
    cfg = TrainConfig(arch=arch, minutes=minutes, seed=seed, **parse_overrides(overrides or []))
    try:
        state = train(cfg, out, resume=resume, init_from=init_from, progress=True, log=lambda s: None,
                      overwrite=overwrite, stop_at_step=stop_at_step)
    except PartStopped as stopped:
        Console().print(f"{out}: {stopped}")
        return
    last = state["curve"][-1] if state["curve"] else {}
    Console().print(f"saved {out}: {state['params']:,} parameters, step {state['step']}, "
                    f"{state['tokens']:,} tokens, {state['seconds'] / 60:.1f} min, length {state['length']}, "
                    f"gate exact match {last.get('exact', {})}")


def eval_command(
    model: Annotated[Path, typer.Option("--model", help="A model directory with its tokenizer (save_pretrained).")],
    task: Annotated[str, typer.Option("--task", help="Task name(s), comma-separated, e.g. niah_single,qa.")],
    length: Annotated[str, typer.Option("--length", help="Context length(s) in tokens, comma-separated, e.g. 512,1024.")],
    n: Annotated[int, typer.Option("--n", min=1, help="Examples per task and length.")] = 20,
    seed: Annotated[int, typer.Option("--seed", min=0, help="Seed of the held-out examples.")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON document (the table goes to stderr).")] = False,
) -> None:
    """Score a model on synthetic tasks with greedy decoding and the full cache; prints a table."""
    _passive_openmp()
    from rich.table import Table

    from kvstate.lab.cli_output import print_json, table_console
    from kvstate.lab.harness import MAX_EXAMPLES, check_lengths_fit, check_tasks, load_reference, run_tasks
    from kvstate.lab.lists import parse_ints, parse_names
    from kvstate.models.loading import load_config

    tasks, lengths = parse_names(task, "--task", example="niah_single,qa"), parse_ints(length, "--length")
    check_tasks(tasks, lengths)  # before loading the model: bad names fail fast
    if not 1 <= n <= MAX_EXAMPLES:
        raise KVStateError(f"--n {n} must be in 1..{MAX_EXAMPLES:,} (examples per task and length)")
    if seed < 0:
        raise KVStateError(f"--seed {seed} must be >= 0")
    check_lengths_fit(load_config(model), lengths)  # the config alone: before reading the weights
    lm, tokenizer = load_reference(model)
    result = run_tasks(lm, tokenizer, tasks, lengths, n, seed, progress=True)
    table = Table(title=f"{model} — full cache, n={n}, seed={seed}")
    for col in ("task", "length", "n", "score", "cache KiB", "prefill ms", "decode ms"):
        table.add_column(col, justify="left" if col == "task" else "right")
    for row in result.scores():
        table.add_row(row.task, str(row.length), str(row.n), f"{row.score:.3f}", f"{row.cache_bytes / 1024:.0f}",
                      f"{row.prefill_s * 1e3:.1f}", f"{row.decode_s * 1e3:.1f}")
    table_console(as_json).print(table)
    if as_json:
        print_json(result.as_json(str(model)))
