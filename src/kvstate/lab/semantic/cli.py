"""``kvstate semantic ...``: train the SEKV router and run the side-by-side benchmark.

Thin wrappers over :mod:`kvstate.lab.semantic.train` and :mod:`kvstate.lab.semantic.bench`; torch and
transformers are imported inside the commands.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from kvstate.errors import KVStateError, OutputError

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="SEKV: resolution-adaptive semantic KV cache (train the router, compare with kvpress).")


@app.command("train")
def train_command(
    model: Annotated[Path, typer.Option(help="Base model directory (frozen).")],
    out: Annotated[Path, typer.Option(help="Where to write router.safetensors, manifest.json and README.md.")],
    minutes: Annotated[float, typer.Option(help="Wall-clock budget.")] = 10.0,
    budget: Annotated[float, typer.Option(help="Budget (fraction of full KV) to train at.")] = 0.25,
    slow_budget: Annotated[float, typer.Option(help="Slow-tier budget (fraction of raw span K/V) the rank gates "
                                                    "are trained under.")] = 0.375,
    lengths: Annotated[str, typer.Option("--length", "--lengths", help="Training context lengths, comma-separated.")] = "512,1024",
    max_steps: Annotated[int | None, typer.Option(help="Stop after this many steps.")] = None,
    threads: Annotated[int, typer.Option(help="torch threads.")] = 1,
    seed: Annotated[int, typer.Option(min=0, help="Seed of the router's initialisation and training items.")] = 0,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Write into an --out directory that already holds files.")] = False,
) -> None:
    """Train the routing projections, zoom thresholds and rank gates on a frozen model."""
    import sys

    from kvstate.io_safety import check_not_input, check_output_dir
    from kvstate.lab.cli_output import set_threads
    from kvstate.lab.harness import load_reference
    from kvstate.lab.lists import parse_ints
    from kvstate.lab.semantic.card import write_card
    from kvstate.lab.semantic.train import TrainConfig, train_router
    from kvstate.models.loading import load_config
    from kvstate.semantic.router import MANIFEST, WEIGHTS, is_router_dir

    cfg = TrainConfig(minutes=minutes, budget=budget, slow_budget=slow_budget, lengths=tuple(parse_ints(lengths, "--length", lo=64)),
                      max_steps=max_steps, seed=seed)
    check_not_input(out, {"--model": model})
    check_output_dir(out, overwrite=overwrite, accept=is_router_dir,
                     kind=f"a SEKV router directory ({WEIGHTS} + {MANIFEST})")
    cfg.check_positions(load_config(model))  # the config alone: before reading the weights
    set_threads(threads)
    base, tok = load_reference(model)
    manifest = train_router(base, tok, out, cfg, progress=True, log=lambda line: print(line, file=sys.stderr, flush=True))
    write_card(out, model, manifest)
    print(json.dumps({k: manifest[k] for k in ("steps", "minutes", "trainable_parameters", "trainable_fraction")}))


def default_router_dir(model: Path) -> Path:
    """Where ``kvstate semantic eval`` looks for a router by default: ``<model dir>-sekv`` next to it."""
    return model.parent / f"{model.name}-sekv"


# the source a semantic evaluation depends on: a change here makes committed eval.json files stale
EVAL_CODE = ("semantic", "models", "lab/semantic/bench.py", "lab/semantic/evaluate.py", "lab/semantic/protocol.py",
             "lab/semantic/methods",
             "lab/semantic/baselines_kvpress.py", "lab/semantic/kvpress_runner.py",
             "lab/decode.py", "lab/perplexity.py", "lab/scoring.py", "lab/stats.py", "lab/workloads/tasks.py",
             "lab/workloads/realtext.py", "lab/models/realtext_eval.py")
DEFAULT_METHODS = "full,sekv,sekv_fresh,sekv_raw,sekv_learned,sentencekv,quest,streaming,kivi,kvpress"


@app.command("methods")
def methods_command(
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON document.")] = False,
) -> None:
    """List the registered methods of `kvstate semantic eval --methods` (name, role, what it is)."""
    from kvstate.lab.semantic import methods as registry

    rows = [{"name": n, "role": m.role, "about": m.about} for n, m in registry.METHODS.items()]
    rows += [{"name": n, "role": a.role, "about": a.about} for n, a in registry.ADAPTERS.items()]
    if as_json:
        print(json.dumps(rows))
        return
    for r in rows:
        print(f"{r['name']:<14} {r['role']:<10} {r['about']}")


@app.command("eval")
def eval_command(
    model: Annotated[Path, typer.Option(help="Model directory.")],
    budget: Annotated[str, typer.Option(help="Budgets: (kept + read) bytes / full KV bytes of the tokens seen, "
                                             "comma-separated (default: the headline grid's 4:1 and 8:1).")] = "0.25,0.125",
    task: Annotated[str, typer.Option(help="Tasks, comma-separated (RULER-shaped tasks, niah_4q: four questions on one "
                                           "compressed cache, and ppl: held-out perplexity, compress the context then "
                                           "continue; on a real model with a chat template real_niah_single, "
                                           "real_niah_multikey, ...: the real-text needle tasks).")] = "niah_single",
    length: Annotated[str, typer.Option(help="Context lengths in tokens, comma-separated.")] = "1024",
    methods: Annotated[str, typer.Option(help="Registered methods, comma-separated (`kvstate semantic methods` "
                                              "lists them): full, sekv and its ablations, the baselines, kvpress "
                                              "(its default presses) or press class names.")] = DEFAULT_METHODS,
    n: Annotated[int, typer.Option(min=1, help="Items per task and length.")] = 4,
    seed: Annotated[int, typer.Option(min=0, help="Seed of the evaluation items (reported numbers: >= 1000).")] = 0,
    router: Annotated[Path | None, typer.Option(help="Router directory (default: <model>-sekv if it exists).")] = None,
    recent: Annotated[int, typer.Option(min=0, help="Recent-window tokens kept at full resolution.")] = 16,
    max_span: Annotated[int, typer.Option(min=3, help="Longest span (SEKV, SentenceKV).")] = 32,
    expand_share: Annotated[float, typer.Option(help="Share of the budget kept free at compression for expanded "
                                                     "spans (SEKV, SentenceKV).")] = 0.6,
    slow_budget: Annotated[float, typer.Option(help="SEKV slow tier: bytes / raw span K/V bytes (0.375: every tier "
                                                    "within 0.5 x full KV at budget 0.125).")] = 0.375,
    memory: Annotated[float | None, typer.Option(help="SEKV: bytes held in every tier / full KV bytes (>= every "
                                                     "--budget); unset: the slow tier under --slow-budget.")] = None,
    slow: Annotated[str, typer.Option(help="SEKV slow tier: lowrank or quant (KIVI-style).")] = "quant",
    bits: Annotated[int, typer.Option(help="SEKV --slow quant: bits per element, 2, 4, 8 or 16.")] = 4,
    kvpress_venv: Annotated[Path, typer.Option(help="Isolated kvpress environment (created if missing).")] = Path(".venv-kvpress"),
    save: Annotated[Path | None, typer.Option(
        "--out", "--save", help="Append this run, with its provenance, to a result file (e.g. DIR/eval.json).")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Start the --out file afresh (drop its runs).")] = False,
    threads: Annotated[int, typer.Option(help="torch threads (also for the kvpress runner).")] = 1,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON document (the table goes to stderr).")] = False,
) -> None:
    """Compress the context, then ask: SEKV side by side with kvpress and in-project baselines, one byte budget."""
    from rich.table import Table

    from kvstate.lab.cli_output import (
        check_results_out,
        notes_console,
        print_json,
        set_threads,
        table_console,
        write_results,
    )
    from kvstate.lab.experiment import preflight, recorder
    from kvstate.lab.harness import MAX_EXAMPLES, check_lengths_fit, load_reference
    from kvstate.lab.journal import open_journal
    from kvstate.lab.lists import parse_floats, parse_ints, parse_names
    from kvstate.lab.progress import progress_bar
    from kvstate.lab.semantic import evaluate as evaluation
    from kvstate.lab.semantic import methods as registry
    from kvstate.lab.semantic.bench import (
        SekvOptions,
        cells,
        run_methods,
        slow_summary,
        summarise,
    )
    from kvstate.lab.semantic.protocol import CONTINUATION, MULTI_Q, PPL, build_items, real_tasks
    from kvstate.lab.workloads.tasks import TASKS
    from kvstate.models.loading import load_config
    from kvstate.semantic.config import SemanticConfig
    from kvstate.semantic.router import RouterConfig, SemanticRouter
    from kvstate.semantic.segment import SegmentConfig

    console = notes_console()
    set_threads(threads)
    budgets = parse_floats(budget, "--budget", lo=0.0, lo_open=True, hi=1.0, example="0.25,0.125,0.0625")
    lengths = parse_ints(length, "--length", lo=64, example="1024,2K")
    tasks = parse_names(task, "--task", [*(x for x in TASKS if x != "text"), MULTI_Q, PPL, *real_tasks()],
                        example="niah_single,ppl")
    chosen = parse_names(methods, "--methods", example="full,sekv,kvpress")
    selection = registry.resolve(chosen)  # unknown names: one error listing the registry
    presses = [p for names in selection.external.values() for p in names]
    if not 1 <= n <= MAX_EXAMPLES:
        raise KVStateError(f"--n {n} must be in 1..{MAX_EXAMPLES:,} (items per task and length)")
    if slow not in ("lowrank", "quant"):
        raise KVStateError(f"--slow {slow!r} must be lowrank or quant (sekv_raw runs the raw slow tier)")
    try:
        segment = SegmentConfig(recent=recent, max_span=max_span)
        SemanticConfig(expand_share=expand_share, slow_budget=slow_budget, segment=segment, bits=bits)
        for b in budgets:
            SemanticConfig(budget=b, memory=memory)
    except ValueError as exc:  # name the option, not the dataclass field
        raise KVStateError(f"--recent / --max-span / --expand-share / --slow-budget / --bits / --budget / --memory: "
                           f"{exc}") from None
    registry.ADAPTERS["kvpress"].venv = kvpress_venv  # type: ignore[attr-defined]
    venv_ok = not kvpress_venv.exists() or (kvpress_venv / "bin" / "python").is_file() or (
        kvpress_venv.is_dir() and not any(kvpress_venv.iterdir()))
    if presses and not venv_ok:  # `python -m venv` would write into whatever directory is there
        raise OutputError(f"--kvpress-venv {str(kvpress_venv)!r} exists and is not a Python environment; pass a new "
                          "path (it is created there) or an existing kvpress environment")
    if save is not None:
        check_results_out(save, overwrite=overwrite)
    config = load_config(model)  # the config alone: lengths are checked before the weights are read
    check_lengths_fit(config, [L + (CONTINUATION if PPL in tasks else 0) for L in lengths])
    runs = [(m, b) for m in selection.methods for b in registry.get(m).budgets(budgets)]
    # the experiment as asked: its provenance is the run's, and the seed ledger is checked before any weight is read
    planned = evaluation.plan(
        runs, selection.external, budgets, tasks, lengths, n, seed, [model, *([router] if router is not None else [])],
        {"budgets": budgets, "threads": threads, "recent": recent, "max_span": max_span,
         "expand_share": expand_share, "slow_budget": slow_budget, "memory": memory, "slow": slow, "bits": bits},
        EVAL_CODE)
    rec = recorder(planned)
    if save is not None:
        preflight(save, rec.finish())
    base, tok = load_reference(model)
    rdir = router if router is not None else default_router_dir(model)
    if (rdir / "router.safetensors").is_file():
        sekv_router = SemanticRouter.load(rdir, base)  # refuses a router trained for another model
        router_note = str(rdir)
    elif router is not None:
        raise KVStateError(f"--router {str(router)!r} holds no router.safetensors")
    else:
        sekv_router = SemanticRouter(RouterConfig.from_model_config(base.config))
        router_note = "untrained (no router found)"
        console.print(f"[yellow]no router at {rdir}; SEKV runs with an untrained router[/]")
    items = [it for t in tasks for L in lengths for it in build_items(tok, t, L, n, seed)]
    outcomes, not_run, slow_log = [], [], []
    # a recorded run is resumable: finished items are journaled beside the result file
    journal = open_journal(save, {
        "model": str(model), "router": router_note, "runs": runs, "presses": presses, "tasks": tasks,
        "lengths": lengths, "n": n, "seed": seed, "recent": recent, "max_span": max_span,
        "expand_share": expand_share, "slow_budget": slow_budget, "memory": memory, "slow": slow, "bits": bits,
        "threads": threads},
        EVAL_CODE, [model, *([rdir] if (rdir / "router.safetensors").is_file() else [])], console.print)
    with progress_bar("semantic eval", len(runs) * len(items), unit="items") as bar:
        # one prefill per item shared by every run; a run below its method's minimum budget is not run
        got, failed = run_methods(runs, base, tok, items, sekv_router, segment, progress=bar.advance,
                                  slow_log=slow_log, expand_share=expand_share, slow_budget=slow_budget,
                                  journal=journal, options=SekvOptions(memory=memory, slow=slow, bits=bits))
    outcomes += got
    not_run += failed
    for e in failed:
        console.print(f"[yellow]{e['method']} at budget {e['budget']} not run:[/] {e['reason']}")
    external: dict[str, Any] = {}
    press_items = [it for it in items if it.task != PPL]  # external runners answer questions only
    for name, names in selection.external.items():
        if len(press_items) < len(items):
            console.print(f"[yellow]ppl is measured for the in-process methods only (not through {name})[/]")
        with progress_bar(name, len(press_items), unit="items") as bar:
            got, failed, external[name] = registry.ADAPTERS[name].run(
                model, press_items, names, budgets, threads, journal, bar.advance, console.print)
        outcomes += got
        not_run += failed
    rows = summarise(outcomes)
    values = evaluation.item_values(outcomes)
    loop = evaluation.measured(planned, values, runs)  # the question tasks through the experiment loop
    result = {**(evaluation.run_loop(loop, values) if loop is not None else
                 {"experiment": None, "rows": [], "pooled": None, "decisions": []}),
              "model": str(model), "router": router_note, "results": rows, "cells": cells(outcomes),
              "not_run": not_run, "slow_tier": slow_summary(slow_log), **external}
    table = Table(title="compress the context, then ask (bytes / full KV)")
    for c in ("method", "budget", "task", "length", "n", "score", "95% CI", "resident", "total", "attended peak",
              "expanded", "ms/token"):
        table.add_column(c, justify="right")
    for r in rows:
        f = max(r["full_bytes"], 1)
        table.add_row(r["method"], str(r["budget"]), r["task"], str(r["length"]), str(r["n"]), f"{r['score']:.3f}",
                      f"[{r['score_ci'][0]:.2f}, {r['score_ci'][1]:.2f}]", f"{r['resident_bytes'] / f:.3f}",
                      f"{r['total_bytes'] / f:.3f}", f"{r['attended_bytes_peak'] / f:.3f}",
                      "" if r["expanded_fraction"] is None else f"{r['expanded_fraction']:.2f}",
                      f"{r['decode_ms_per_token']:.2f}")
    for e in not_run:
        table.add_row(e["method"], str(e["budget"]), "not run", "", "", "", "", "", "", "", "", e["reason"][:60])
    table_console(as_json).print(table)
    prov = rec.finish() if journal is None else journal.stamp(rec.finish())
    printed = {**result, "provenance": prov}
    if save is not None:
        write_results(save, result, prov, overwrite=overwrite)
        if journal is not None:
            journal.close()
        from kvstate.integrity import artifact_kind

        if save.name == "eval.json" and artifact_kind(save.parent) == "router":  # the router's card quotes it
            from kvstate.lab.semantic.card import write_card

            write_card(save.parent, model)
    if as_json:
        print_json(printed)
