"""``kvstate prefix ...``: replay request traces through the sparse prefix cache on a real model.

A ``typer`` sub-app registered by ``cli.py`` with one line. ``trace`` writes a seeded workload trace in a
model's vocabulary; ``replay`` serves it through :class:`kvstate.prefix.SparsePrefixCache` (one
transaction per request) and against no cache, and prints tokens reused / recomputed / lost, hit rate,
peak bytes by kind, evictions, wall-clock and the offline evaluation's prediction. torch and
transformers are imported inside the commands only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from kvstate.errors import KVStateError

app = typer.Typer(
    add_completion=False, no_args_is_help=True, help="Sparse prefix caching: traces and replay."
)
console = Console()


@app.command("trace")
def trace_command(
    workload: Annotated[
        str, typer.Option("--workload", help="quality, narrativeqa, system_prompts or chat.")
    ],
    out: Annotated[Path, typer.Option("--out", help="JSONL file to write.")],
    n: Annotated[int, typer.Option("-n", help="Requests.")] = 200,
    scale: Annotated[float, typer.Option("--scale", help="Multiply every length (e.g. 0.125).")] = 0.125,
    vocab: Annotated[int, typer.Option("--vocab", help="Token ids are drawn from 0..vocab-1.")] = 128,
    seed: Annotated[int, typer.Option("--seed")] = 0,
) -> None:
    """Write a seeded request trace (token ids in 0..VOCAB-1)."""
    from kvstate.lab.workloads.traces import generate, write_trace

    try:
        reqs = generate(workload, n, seed=seed, vocab=vocab, scale=scale)
    except ValueError as exc:
        raise KVStateError(str(exc)) from exc
    write_trace(out, reqs)
    console.print(f"{len(reqs)} requests, {sum(r.length for r in reqs):,} tokens → {out}")


@app.command("replay")
def replay_command(
    model_dir: Annotated[Path, typer.Option("--model", help="A local model directory.")],
    trace: Annotated[Path, typer.Option("--trace", help="A JSONL trace with token ids.")],
    budget_bytes: Annotated[int, typer.Option("--budget-bytes", help="Byte budget of the store.")],
    slots: Annotated[
        list[int], typer.Option("--slots", help="Checkpoint slots per request path (repeatable).")
    ],
    planner: Annotated[list[str], typer.Option("--planner", help="Placement method (repeatable).")],
    limit: Annotated[int | None, typer.Option("--limit", help="Only the first N requests.")] = None,
    align: Annotated[
        int | None, typer.Option("--align", help="Checkpoint grid (default: chunk size).")
    ] = None,
    policy: Annotated[str, typer.Option("--policy", help="lru or utility.")] = "lru",
    placement: Annotated[
        str, typer.Option("--placement", help="path (one plan per request path) or tree (exact DP over the radix tree).")
    ] = "path",
    no_baseline: Annotated[bool, typer.Option("--no-baseline", help="Skip the no-cache timing.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON line last.")] = False,
) -> None:
    """Replay a trace through the prefix cache; one row per (planner, slots)."""
    from rich.progress import Progress

    from kvstate.lab.prefix.replay import replay
    from kvstate.lab.workloads.traces import read_trace
    from kvstate.models import load_model
    from kvstate.prefix.config import PrefixCacheConfig

    requests = read_trace(trace)
    if limit is not None:
        if limit < 1:
            raise KVStateError(f"--limit {limit} must be >= 1.")
        requests = requests[:limit]
    configs = [
        PrefixCacheConfig(budget_bytes, m, p, align, policy, placement=placement) for p in planner for m in slots
    ]
    model = load_model(model_dir)
    results = []
    base: list[float] | None = None  # the no-cache pass runs once; later rows reuse its times
    with Progress(console=console, transient=True) as bar:
        for cfg in configs:
            task = bar.add_task(f"{cfg.planner} M={cfg.slots_per_entry}", total=len(requests))
            r = replay(
                model,
                requests,
                cfg,
                no_cache_baseline=not no_baseline,
                baseline_s=base,
                progress=lambda k, t=task: bar.advance(t, k),
            )
            if not no_baseline and base is None:
                base = [row["wall_s_no_cache"] for row in r.per_request]
            results.append(r)
    table = Table(title=f"prefix replay: {model_dir} on {trace} ({len(requests)} requests)")
    for col in (
        "planner",
        "M",
        "reused",
        "predicted",
        "recomputed",
        "lost",
        "hit rate",
        "peak MiB",
        "evictions",
        "wall s",
        "no-cache s",
        "R²",
    ):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(
            r.planner if r.placement == "path" else f"{r.planner} ({r.placement})",
            str(r.slots),
            f"{r.tokens_reused:,}",
            f"{r.predicted_reused:,}",
            f"{r.tokens_recomputed:,}",
            f"{r.tokens_lost:,}",
            f"{r.hit_rate:.2f}",
            f"{r.peak_bytes / 2**20:.1f}",
            f"{r.evicted_nodes}+{r.evicted_states}",
            f"{r.wall_s:.2f}",
            f"{r.wall_s_no_cache:.2f}",
            f"{r.saved_r2:.3f}",
        )
    console.print(table)
    if as_json:
        print(
            json.dumps(
                {"model": str(model_dir), "trace": str(trace), "results": [r.as_json() for r in results]}
            )
        )
