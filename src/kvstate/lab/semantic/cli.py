"""``kvstate semantic ...``: train the SEKV router and run the side-by-side benchmark.

Thin wrappers over :mod:`kvstate.lab.semantic.train` and :mod:`kvstate.lab.semantic.bench`; torch and
transformers are imported inside the commands.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from kvstate.errors import KVStateError

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="SEKV: resolution-adaptive semantic KV cache (train the router, compare with kvpress).")


def _ints(text: str, name: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise KVStateError(f"--{name} {text!r} must be comma-separated integers, e.g. 512,1024") from None


def _floats(text: str, name: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise KVStateError(f"--{name} {text!r} must be comma-separated numbers, e.g. 0.5,0.25") from None


@app.command("train")
def train_command(
    model: Annotated[Path, typer.Option(help="Base model directory (frozen).")],
    out: Annotated[Path, typer.Option(help="Where to write router.safetensors, manifest.json and README.md.")],
    minutes: Annotated[float, typer.Option(help="Wall-clock budget.")] = 10.0,
    budget: Annotated[float, typer.Option(help="Fast-tier budget (fraction of full KV) to train at.")] = 0.25,
    lengths: Annotated[str, typer.Option(help="Training context lengths, comma-separated.")] = "512,1024",
    max_steps: Annotated[int | None, typer.Option(help="Stop after this many steps.")] = None,
    threads: Annotated[int, typer.Option(help="torch threads.")] = 1,
    seed: Annotated[int, typer.Option()] = 0,
) -> None:
    """Train the routing projections, zoom thresholds and rank gates on a frozen model."""
    import torch

    from kvstate.lab.harness import load_reference
    from kvstate.lab.semantic.card import write_card
    from kvstate.lab.semantic.train import TrainConfig, train_router

    torch.set_num_threads(threads)
    cfg = TrainConfig(minutes=minutes, budget=budget, lengths=tuple(_ints(lengths, "lengths")), max_steps=max_steps,
                      seed=seed)
    base, tok = load_reference(model)
    manifest = train_router(base, tok, out, cfg, progress=True, log=lambda line: print(line, flush=True))
    write_card(out, model, manifest)
    print(json.dumps({k: manifest[k] for k in ("steps", "minutes", "trainable_parameters", "trainable_fraction")}))


def merge_results(old: dict, new: dict) -> dict:
    """``old`` with ``new``'s rows and cells added; rows of the same (method, budget, task, length) replaced."""
    def key(r: dict) -> tuple:
        return (r["method"], r["budget"], r["task"], r["length"])

    replaced = {key(r) for r in new["results"]}
    merged = dict(new)
    merged["results"] = [r for r in old["results"] if key(r) not in replaced] + new["results"]
    merged["cells"] = [c for c in old.get("cells", []) if key(c) not in replaced] + new.get("cells", [])
    if not new.get("kvpress", {}).get("presses"):  # this run had no presses: keep the earlier run's kvpress info
        merged["kvpress"] = old.get("kvpress", new.get("kvpress"))
    merged["command"] = "; ".join(x for x in (old.get("command", ""), new.get("command", "")) if x)
    return merged


def default_router_dir(model: Path) -> Path:
    """Where ``kvstate semantic eval`` looks for a router by default: ``<model dir>-sekv`` next to it."""
    return model.parent / f"{model.name}-sekv"


@app.command("eval")
def eval_command(
    model: Annotated[Path, typer.Option(help="Model directory.")],
    budget: Annotated[str, typer.Option(help="Fast-tier budgets (fraction of full KV), comma-separated.")] = "0.25",
    task: Annotated[str, typer.Option(help="Tasks, comma-separated (RULER-shaped tasks, niah_4q, and ppl: held-out "
                                           "perplexity, compress the context then continue).")] = "niah_single",
    length: Annotated[str, typer.Option(help="Context lengths in tokens, comma-separated.")] = "1024",
    methods: Annotated[str, typer.Option(help="full, sekv, sentencekv, quest, kvpress (its default presses) or press "
                                              "class names, comma-separated.")] = "full,sekv,sentencekv,quest,kvpress",
    n: Annotated[int, typer.Option(help="Items per task and length.")] = 4,
    seed: Annotated[int, typer.Option()] = 0,
    router: Annotated[Path | None, typer.Option(help="Router directory (default: <model>-sekv if it exists).")] = None,
    kvpress_venv: Annotated[Path, typer.Option(help="Isolated kvpress environment (created if missing).")] = Path(".venv-kvpress"),
    save: Annotated[Path | None, typer.Option(help="Also write the JSON here (atomically).")] = None,
    append: Annotated[bool, typer.Option(help="Merge into an existing --save file (same rows replaced).")] = False,
    threads: Annotated[int, typer.Option(help="torch threads (also for the kvpress runner).")] = 1,
    as_json: Annotated[bool, typer.Option("--json", help="Print the results as one JSON line last.")] = False,
) -> None:
    """Compress the context, then ask: SEKV side by side with kvpress and in-project baselines."""
    import sys
    import tempfile

    import torch
    from rich.console import Console
    from rich.table import Table
    from tqdm.auto import tqdm

    from kvstate.lab.harness import load_reference
    from kvstate.lab.report.html import atomic_write_text
    from kvstate.lab.semantic import baselines_kvpress as kp
    from kvstate.lab.semantic.bench import IN_PROCESS, cells, run_method, summarise
    from kvstate.lab.semantic.protocol import MULTI_Q, PPL, build_items
    from kvstate.lab.workloads.tasks import TASKS
    from kvstate.semantic.router import RouterConfig, SemanticRouter
    from kvstate.semantic.segment import SegmentConfig

    console = Console(stderr=True)
    torch.set_num_threads(threads)
    budgets, lengths = _floats(budget, "budget"), _ints(length, "length")
    tasks = [t.strip() for t in task.split(",") if t.strip()]
    for t in tasks:
        if t not in (*TASKS, MULTI_Q, PPL) or t == "text":
            raise KVStateError(f"unknown task {t!r}; choose from "
                               f"{', '.join([*(x for x in TASKS if x != 'text'), MULTI_Q, PPL])}")
    for b in budgets:
        if not 0 < b <= 1:
            raise KVStateError(f"--budget {b} must be in (0, 1]")
    chosen = [m.strip() for m in methods.split(",") if m.strip()]
    presses = [p for m in chosen for p in (kp.DEFAULT_PRESSES if m == "kvpress" else (m,) if m.endswith("Press") else ())]
    unknown = [m for m in chosen if m not in IN_PROCESS and m != "kvpress" and not m.endswith("Press")]
    if unknown:
        raise KVStateError(f"unknown method(s) {unknown}; choose from {', '.join(IN_PROCESS)}, kvpress or press class names")
    base, tok = load_reference(model)
    rdir = router if router is not None else default_router_dir(model)
    if (rdir / "router.safetensors").is_file():
        sekv_router = SemanticRouter.load(rdir, base)
        router_note = str(rdir)
    elif router is not None:
        raise KVStateError(f"--router {str(router)!r} holds no router.safetensors")
    else:
        sekv_router = SemanticRouter(RouterConfig.from_model_config(base.config))
        router_note = "untrained (no router found)"
        console.print(f"[yellow]no router at {rdir}; SEKV runs with an untrained router[/]")
    segment = SegmentConfig()
    items = [it for t in tasks for L in lengths for it in build_items(tok, t, L, n, seed)]
    outcomes = []
    in_proc = [m for m in chosen if m in IN_PROCESS]
    runs = [(m, b) for m in in_proc for b in (budgets if m != "full" else [1.0])]
    bar = tqdm(total=len(runs) * len(items), desc="semantic eval", unit="item", file=sys.stderr)
    for m, b in runs:
        outcomes += run_method(m, base, tok, items, b, sekv_router, segment, progress=lambda: bar.update(1))
    bar.close()
    kv_info: dict = {"presses": presses, "not_run": kp.NOT_RUN}
    press_items = [it for it in items if it.task != PPL]  # the kvpress runner answers questions only
    if presses and len(press_items) < len(items):
        console.print("[yellow]ppl is measured for the in-process methods only (not through kvpress presses)[/]")
    if presses and press_items:
        try:
            py = kp.ensure_env(kvpress_venv)
            kv_info["versions"] = kp.versions(py)
            console.print(f"kvpress: {len(presses)} presses x {len(budgets)} budgets x {len(press_items)} items (isolated env)")
            with tempfile.TemporaryDirectory() as work:
                got, errors = kp.run_presses(py, model, press_items, presses, budgets, Path(work), threads)
            outcomes += got
            kv_info["errors"] = errors[:20]
        except KVStateError as exc:  # say why, run the rest
            console.print(f"[red]kvpress baselines not run:[/] {exc}")
            kv_info["error"] = str(exc)
    rows = summarise(outcomes)
    result = {"model": str(model), "router": router_note, "results": rows, "cells": cells(outcomes), "kvpress": kv_info,
              "command": "kvstate semantic eval " + " ".join(sys.argv[3:] if sys.argv[1:3] == ["semantic", "eval"] else sys.argv[1:])}
    table = Table(title="compress the context, then ask")
    for c in ("method", "budget", "task", "length", "n", "score", "fast bytes", "slow bytes", "ms/token", "expanded"):
        table.add_column(c, justify="right")
    for r in rows:
        table.add_row(r["method"], str(r["budget"]), r["task"], str(r["length"]), str(r["n"]), f"{r['score']:.3f}",
                      f"{r['fast_bytes']:,}", f"{r['slow_bytes']:,}", f"{r['decode_ms_per_token']:.2f}",
                      "" if r["expanded_fraction"] is None else f"{r['expanded_fraction']:.2f}")
    console.print(table)
    text = json.dumps(result)
    if save is not None:
        if append and save.is_file():
            result = merge_results(json.loads(save.read_text()), result)
        atomic_write_text(save, json.dumps(result, indent=1) + "\n")
        if (save.parent / "manifest.json").is_file():
            from kvstate.lab.semantic.card import write_card

            write_card(save.parent, model)
    if as_json:
        print(text)
