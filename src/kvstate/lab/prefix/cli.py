"""``kvstate prefix ...``: replay request traces through the sparse prefix cache on a real model.

A ``typer`` sub-app registered by ``cli.py`` with one line. ``trace`` writes a seeded workload trace in a
model's vocabulary; ``replay`` serves it through :class:`kvstate.prefix.SparsePrefixCache` (one
transaction per request) and against no cache, and prints tokens reused / recomputed / lost, hit rate,
peak bytes by kind, evictions, wall-clock and the offline evaluation's prediction. torch and
transformers are imported inside the commands only.
"""

from __future__ import annotations

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
    n: Annotated[int, typer.Option("--n", "-n", min=1, help="Requests.")] = 200,
    scale: Annotated[float, typer.Option("--scale", help="Multiply every length (e.g. 0.125).")] = 0.125,
    vocab: Annotated[int, typer.Option("--vocab", help="Token ids are drawn from 0..vocab-1.")] = 128,
    seed: Annotated[int, typer.Option("--seed", min=0, help="Seed of the requests.")] = 0,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing --out file.")] = False,
) -> None:
    """Write a seeded request trace (token ids in 0..VOCAB-1)."""
    from kvstate.lab.cli_output import check_out_file
    from kvstate.lab.workloads.traces import generate, write_trace

    check_out_file(out, overwrite=overwrite)
    try:
        reqs = generate(workload, n, seed=seed, vocab=vocab, scale=scale)
    except ValueError as exc:
        raise KVStateError(str(exc)) from exc
    write_trace(out, reqs)
    console.print(f"{len(reqs)} requests, {sum(r.length for r in reqs):,} tokens → {out}")


@app.command("replay")
def replay_command(
    trace: Annotated[Path, typer.Option("--trace", help="A JSONL trace with token ids.")],
    model_dir: Annotated[Path | None, typer.Option("--model", help="A local model directory (not with --server).")] = None,
    budget_bytes: Annotated[
        int | None, typer.Option("--budget-bytes", help="Byte budget of the store (not with --server).")
    ] = None,
    slots: Annotated[
        list[str] | None,
        typer.Option("--slots", help="Checkpoint slots per request path: a comma-separated list or repeated."),
    ] = None,
    planner: Annotated[
        list[str] | None, typer.Option("--planner", help="Placement methods: a comma-separated list or repeated.")
    ] = None,
    limit: Annotated[int | None, typer.Option("--limit", help="Only the first N requests.")] = None,
    align: Annotated[
        int | None, typer.Option("--align", help="Checkpoint grid (default: chunk size).")
    ] = None,
    policy: Annotated[str, typer.Option("--policy", help="lru or utility.")] = "lru",
    placement: Annotated[
        str, typer.Option("--placement", help="path (one plan per request path) or tree (exact DP over the radix tree).")
    ] = "path",
    no_baseline: Annotated[bool, typer.Option("--no-baseline", help="Skip the no-cache timing.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON document (the table goes to stderr).")] = False,
    replicas: Annotated[
        int, typer.Option("--replicas", min=1, help="Serve round-robin over R engines sharing --remote.")
    ] = 1,
    remote: Annotated[
        str | None, typer.Option("--remote", help="Shared Redis tier, redis://HOST:PORT/DB (flushed per repeat).")
    ] = None,
    repeats: Annotated[
        int, typer.Option("--repeats", min=1, help="Interleaved timing repeats with and without the cache (medians).")
    ] = 1,
    declare: Annotated[
        bool, typer.Option("--declare-boundaries", help="Each request declares where it parts from the others.")
    ] = False,
    server: Annotated[
        str | None, typer.Option("--server", help="Replay through a running `kvstate serve` (URL): time to first token.")
    ] = None,
    baseline_server: Annotated[
        str | None, typer.Option("--baseline-server", help="With --server: the same model served with the cache off.")
    ] = None,
) -> None:
    """Replay a trace through the prefix cache; one row per (planner, slots)."""
    from kvstate.lab.cli_output import print_json, table_console
    from kvstate.lab.lists import parse_ints, parse_names
    from kvstate.lab.prefix.replay import replay
    from kvstate.lab.progress import progress_bar
    from kvstate.lab.workloads.traces import read_trace
    from kvstate.models import load_model
    from kvstate.prefix.config import PrefixCacheConfig
    from kvstate.prefix.placement import Placement

    if server is not None:
        _replay_server(server, baseline_server, trace, limit, as_json)
        return
    missing = [f for f, v in (("--model", model_dir), ("--budget-bytes", budget_bytes), ("--slots", slots),
                              ("--planner", planner)) if v is None]
    if missing or model_dir is None or budget_bytes is None or slots is None or planner is None:
        raise KVStateError(f"replay needs {', '.join(missing)} (or --server URL to replay through a running server).")
    if replicas > 1 and remote is None:
        raise KVStateError(f"--replicas {replicas} needs --remote redis://HOST:PORT/DB (the tier they share).")
    slot_counts = parse_ints(",".join(slots), "--slots", lo=0, hi=2**20, example="0,2,8")
    planners = parse_names(",".join(planner), "--planner", example="optimal,balanced")
    requests = read_trace(trace)
    if limit is not None:
        if limit < 1:
            raise KVStateError(f"--limit {limit} must be >= 1.")
        requests = requests[:limit]
    configs = [
        PrefixCacheConfig(budget_bytes, m, p, align, policy, placement=placement, remote=remote)
        for p in planners
        for m in slot_counts
    ]
    model = load_model(model_dir)
    results = []
    base: list[float] | None = None  # the no-cache pass runs once; later rows reuse its times
    for cfg in configs:
        with progress_bar(f"{cfg.planner} M={cfg.slots_per_entry}", len(requests), unit="requests") as bar:
            r = replay(
                model,
                requests,
                cfg,
                no_cache_baseline=not no_baseline,
                baseline_s=base if repeats == 1 else None,
                progress=bar.advance,
                replicas=replicas,
                repeats=repeats,
                declare=declare,
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
        "ratio (spread)",
    ):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(
            r.planner if r.placement == Placement.PATH else f"{r.planner} ({r.placement})",
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
            f"{r.wall_ratio:.2f} ({r.wall_ratio_min:.2f}-{r.wall_ratio_max:.2f})",
        )
    table_console(as_json).print(table)
    if as_json:
        print_json({"model": str(model_dir), "trace": str(trace), "results": [r.as_json() for r in results]})


def _replay_server(server: str, baseline: str | None, trace: Path, limit: int | None, as_json: bool) -> None:
    from kvstate.lab.cli_output import print_json, table_console
    from kvstate.lab.prefix.replay_server import replay_server
    from kvstate.lab.progress import progress_bar
    from kvstate.lab.workloads.traces import read_trace

    requests = read_trace(trace)[:limit] if limit else read_trace(trace)
    with progress_bar("server", len(requests), unit="requests") as bar:
        r = replay_server(server, requests, baseline_url=baseline, progress=bar.advance)
    table = Table(title=f"prefix replay through {server} on {trace} ({r.requests} requests)")
    for col in ("TTFT median s", "no-cache TTFT s", "ratio", "tokens reused"):
        table.add_column(col, justify="right")
    table.add_row(
        f"{r.ttft_s_median:.3f}", f"{r.ttft_s_median_baseline:.3f}", f"{r.ttft_ratio:.2f}", f"{r.tokens_reused:,.0f}"
    )
    table_console(as_json).print(table)
    if as_json:
        print_json({"server": server, "trace": str(trace), "result": r.as_json()})


def _grid(value: str) -> tuple[tuple[int, int], ...]:
    try:
        pairs = [tuple(int(x) for x in item.split(":")) for item in value.split(",") if item.strip()]
    except ValueError:
        pairs = []
    if not pairs or any(len(p) != 2 or p[0] < 1 or p[1] < 1 for p in pairs):
        raise KVStateError(f"--grid {value!r}: pass budget:slots pairs, e.g. 1073741824:8,33554432:2")
    return tuple((p[0], p[1]) for p in pairs)


@app.command("replay-bench")
def replay_bench_command(
    out: Annotated[Path | None, typer.Option(
        "--out", help="Result file the run is appended to (models/ref-hybrid/prefix_replay.json: a fresh test seed).")
    ] = None,
    requests: Annotated[int, typer.Option("--requests", min=1, help="Requests per workload.")] = 200,
    scale: Annotated[float, typer.Option("--scale", min=1e-4, help="Multiply every trace length.")] = 0.125,
    seed: Annotated[int, typer.Option("--seed", min=0, help="Trace seed: < 1000 tuning; a result under models/ "
                                      "takes a fresh test seed (models/seeds_used.json).")] = 0,
    repeats: Annotated[int, typer.Option("--repeats", min=1, help="Interleaved timing repeats (>= 5 for a "
                                         "timing target).")] = 5,
    declare: Annotated[bool, typer.Option("--declare", help="Requests declare where they part.")] = False,
    no_example: Annotated[bool, typer.Option("--no-example", help="Skip the 12-request example.")] = False,
    planners: Annotated[str, typer.Option("--planners", help="Registered planners, comma-separated (an unknown "
                                          "name lists the registry).")] = "optimal,balanced",
    workloads: Annotated[str, typer.Option("--workloads", help="Comma-separated workloads.")] =
        "quality,narrativeqa,system_prompts,chat",
    placement: Annotated[str | None, typer.Option("--placement", help="Compare placements instead, e.g. path,tree "
                                                  "(planner: the first of --planners).")] = None,
    grid: Annotated[str, typer.Option("--grid", help="budget:slots pairs for --placement, comma-separated.")] =
        "1073741824:8",
    no_baseline: Annotated[bool, typer.Option("--no-baseline", help="Skip the no-cache prefills.")] = False,
    model_dir: Annotated[Path, typer.Option("--model", help="The model directory.")] = Path("models/ref-hybrid"),
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Start the --out file afresh (drop its runs).")] = False,
) -> None:
    """The replay benchmark the report reads: workloads x planners through the engine (or tree vs path placement)."""
    from kvstate.lab.lists import parse_names
    from kvstate.lab.prefix.bench import WORKLOADS, ReplayBench, run_bench
    from kvstate.lab.workloads.traces import WORKLOADS as KNOWN
    from kvstate.prefix.placement import Placement, planner_names

    bench = ReplayBench(
        requests=requests, scale=scale, seed=seed, repeats=repeats, declare=declare, example=not no_example,
        planners=tuple(parse_names(planners, "--planners", list(planner_names()), example="optimal,balanced")),
        workloads=tuple(parse_names(workloads, "--workloads", list(KNOWN), example=",".join(WORKLOADS[:2]))),
        placement=tuple(parse_names(placement, "--placement", [m.value for m in Placement], example="path,tree"))
        if placement else (),
        grid=_grid(grid), baseline=not no_baseline, model=model_dir)
    run_bench(bench, out, overwrite=overwrite)


if __name__ == "__main__":  # `python -m kvstate.lab.prefix.cli replay-bench ...`: imports only this axis's modules,
    app()  # so a result's executed-file digest does not go stale when another axis's command line changes
