"""The ``kvstate`` command line: thin wrappers that parse arguments, call library functions and print.

One error path: every failure a user can cause — a usage error, or a :class:`KVStateError` raised where
the input is read (model loading, config parsing, file I/O translate the errors of safetensors,
transformers and the OS there) — prints one unwrapped line on stderr naming the input and the fix and
exits with code 2; ``--debug`` shows the traceback instead. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import difflib
import os
import sys
from pathlib import Path
from typing import Annotated

import typer
import typer.main
from rich.console import Console
from rich.table import Table
from typer.core import TyperGroup

from kvstate.errors import KVStateError
from kvstate.io_safety import check_output_file
from kvstate.lab.cli_output import print_json
from kvstate.lab.lists import parse_names

try:  # typer >= 0.20 runs on its own vendored copy of click
    from typer._click import core as click_core
    from typer._click import exceptions as click_exc
except ImportError:  # pragma: no cover
    from click import core as click_core  # type: ignore[no-redef]
    from click import exceptions as click_exc  # type: ignore[no-redef]

# The commands each axis adds, imported only when invoked (or listed by --help): a run executes its own
# axis's code and no other, so the executed-code digest of a result (kvstate.lab.provenance) changes only
# when code that run used changes. name: (module, attribute, help of a single command; None: a Typer group).
LAZY_COMMANDS: dict[str, tuple[str, str, str | None]] = {
    "train": ("kvstate.lab.training.cli", "train_command",
              "Train a small reference model on the synthetic tasks (not run by make test)."),
    "eval": ("kvstate.lab.training.cli", "eval_command", "Score a model on synthetic tasks under the full cache."),
    "prefix": ("kvstate.lab.prefix.cli", "app", None),
    "depth": ("kvstate.lab.depth.cli", "app", None),
    "semantic": ("kvstate.lab.semantic.cli", "app", None),
    "transfer": ("kvstate.lab.transfer.cli", "app", None),
    "lab": ("kvstate.lab.make.cli", "app", None),
    "models": ("kvstate.lab.models.cli", "app", None),
    "serve": ("kvstate.serve.cli", "serve_command",
              "An OpenAI-compatible server with the sparse prefix cache under every request."),
}


def _lazy_command(name: str) -> click_core.Command:
    import importlib

    module, attr, help_text = LAZY_COMMANDS[name]
    obj = getattr(importlib.import_module(module), attr)
    if help_text is None:  # a Typer sub-application: its click group, named as the command
        group = typer.main.get_command(obj)
        group.name = name
        return group
    single = typer.Typer(add_completion=False)
    single.command(name, help=help_text)(obj)
    return typer.main.get_command(single)


class LazyGroup(TyperGroup):
    """The top-level group: the eager commands above, and :data:`LAZY_COMMANDS` loaded on first use."""

    def list_commands(self, ctx: click_core.Context) -> list[str]:
        return [*super().list_commands(ctx), *(n for n in LAZY_COMMANDS if n not in self.commands)]

    def get_command(self, ctx: click_core.Context, cmd_name: str) -> click_core.Command | None:
        if cmd_name in LAZY_COMMANDS and cmd_name not in self.commands:
            self.commands[cmd_name] = _lazy_command(cmd_name)
        return super().get_command(ctx, cmd_name)

    def resolve_command(self, ctx: click_core.Context, args: list[str]) -> tuple[str | None, click_core.Command | None, list[str]]:
        try:
            return super().resolve_command(ctx, args)
        except click_exc.UsageError as exc:  # suggest among the lazy names too
            close = difflib.get_close_matches(args[0], self.list_commands(ctx)) if args else []
            if close and "Did you mean" not in exc.message:
                exc.message = f"{exc.message.rstrip('.')}. Did you mean {', '.join(map(repr, close))}?"
            raise


app = typer.Typer(add_completion=False, no_args_is_help=True, cls=LazyGroup,
                  help="Manage the state an LLM carries between tokens.")
console = Console()
err = Console(stderr=True)
_state = {"debug": False}

PLOT_SUFFIXES = (".png", ".pdf", ".svg", ".jpg", ".jpeg", ".webp", ".tif", ".tiff", ".eps", ".ps")
DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16"}


@app.callback()
def _main(debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks on errors.")] = False) -> None:
    _state["debug"] = debug
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def _torch_dtype(name: str | None):  # type: ignore[no-untyped-def]
    import torch

    if name is None:
        return None
    if name not in DTYPES:
        raise KVStateError(f"--dtype {name!r} is not one of {sorted(DTYPES)}.")
    return getattr(torch, DTYPES[name])


@app.command()
def info(
    model_dir: Annotated[Path, typer.Argument(help="A local model directory (save_pretrained output).")],
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    dtype: Annotated[str | None, typer.Option(help="Account in this dtype instead of the config's.")] = None,
) -> None:
    """Layer kinds, attention KV bytes per token, bytes of one recurrent checkpoint, chunk size.

    Reads the config only (offline), so it works on a model of any size without loading weights.
    """
    from kvstate.models import describe, load_config

    result = describe(load_config(model_dir), _torch_dtype(dtype))
    if as_json:
        print_json(result.as_json())
        return
    kinds = result.layer_kinds
    table = Table(title=f"{model_dir} — {result.family}", show_header=False)
    table.add_row("layers", " ".join(k[0].upper() for k in kinds) + "   (A attention, R recurrent, H hybrid, N none)")
    table.add_row("layer mix", ", ".join(f"{kinds.count(k)} {k}" for k in ("attention", "recurrent", "hybrid", "none") if kinds.count(k)))
    table.add_row("dtype", result.dtype)
    table.add_row("attention KV per token", f"{result.kv_bytes_per_token:,} B")
    table.add_row("one recurrent checkpoint", f"{result.checkpoint_bytes:,} B ({result.checkpoint_bytes / 2**20:.2f} MiB)")
    if result.checkpoint_tokens is not None and result.checkpoint_bytes:
        table.add_row("ratio", f"one checkpoint ≈ {result.checkpoint_tokens:,.0f} tokens of KV")
    table.add_row("chunk size", str(result.chunk_size or "— (attention only)"))
    console.print(table)


@app.command()
def report(
    out: Annotated[Path, typer.Option("--out", help="Output directory.")] = Path("report"),
    models_dir: Annotated[Path, typer.Option("--models", help="Directory of embedded reference models.")] = Path("models"),
    section: Annotated[list[str] | None, typer.Option("--section", help="Only this section (repeatable).")] = None,
) -> None:
    """The main job: every technique's section on the embedded default models → DIR/index.html + summary.json.

    Built in a temporary sibling directory and swapped in when complete: a failed run leaves the previous
    report untouched. A DIR that exists and is not a kvstate report is refused.
    """
    from kvstate.io_safety import check_output_dir
    from kvstate.lab.make.build import build_report

    check_output_dir(out, overwrite=True)  # an unwritable --out fails before the sections run
    index = build_report(out, models_dir, only=section or None)
    console.print(f"report written: {index} and {out / 'summary.json'}")


@app.command()
def plan(
    slots: Annotated[int, typer.Option("--slots", help="Checkpoint slots M.")],
    weights: Annotated[Path | None, typer.Option("--weights", help="A .npy of overlap-depth weights (length N+1).")] = None,
    trace: Annotated[Path | None, typer.Option("--trace", help="A JSONL trace (see kvstate.lab.workloads.traces).")] = None,
    prefix_id: Annotated[str | None, typer.Option("--prefix-id", help="Only this prefix's requests of the trace.")] = None,
    method: Annotated[list[str] | None, typer.Option(
        "--method", help="Methods to compare: a comma-separated list or repeated (default: all).")] = None,
    align: Annotated[int, typer.Option("--align", help="Checkpoints on multiples of this (chunk size).")] = 1,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    plot_path: Annotated[Path | None, typer.Option("--plot", help="Write a PNG of weights and checkpoints.")] = None,
) -> None:
    """Checkpoint positions and expected recompute per placement method, side by side (sparse prefix caching)."""
    import numpy as np

    from kvstate.lab.workloads.traces import overlap_weights, read_trace
    from kvstate.prefix.placement import expected_recompute, plan_checkpoints, planner_names

    if (weights is None) == (trace is None):
        raise KVStateError("pass exactly one of --weights FILE.npy or --trace FILE.jsonl.")
    names = list(planner_names())  # the registry: an unknown --method lists it
    methods = parse_names(",".join(method), "--method", names, example="optimal,block") if method else names
    if plot_path is not None:
        check_output_file(plot_path, "--plot")
        if plot_path.suffix.lower() not in PLOT_SUFFIXES:
            raise KVStateError(f"--plot {str(plot_path)!r}: no image format for suffix {plot_path.suffix!r}; "
                               f"end the name in one of {', '.join(PLOT_SUFFIXES)}")
    if weights is not None:
        if not weights.is_file():
            raise KVStateError(f"--weights {str(weights)!r} {'is a directory' if weights.is_dir() else 'does not exist'}; "
                               "pass a .npy file")
        try:
            w = np.load(weights, allow_pickle=False)
        except (ValueError, OSError, EOFError) as exc:
            raise KVStateError(f"--weights {str(weights)!r} is not a readable .npy array ({exc}); save one with "
                               "numpy.save") from None
        if not isinstance(w, np.ndarray):  # an .npz archive
            raise KVStateError(f"--weights {str(weights)!r} is an .npz archive; pass one .npy array")
    else:
        assert trace is not None
        w = overlap_weights(read_trace(trace), prefix_id)
    try:
        plans = {m: plan_checkpoints(w, slots, m, align) for m in methods}
    except ValueError as exc:
        raise KVStateError(f"{exc} (--weights/--trace, --slots, --align)") from None
    rows = {m: {"positions": p, "expected_recompute": expected_recompute(w, p)} for m, p in plans.items()}
    if plot_path is not None:
        _plot_plan(plot_path, w, plans)
    if as_json:
        print_json({"n": len(w) - 1, "slots": slots, "align": align, "methods": rows})
        return
    table = Table(title=f"checkpoint placement: N={len(w) - 1}, M={slots}, align={align}")
    table.add_column("method")
    table.add_column("expected recompute (tokens)", justify="right")
    table.add_column("positions")
    for m, r in rows.items():
        pos = r["positions"]
        shown = ", ".join(map(str, pos[:12])) + (" …" if len(pos) > 12 else "")
        table.add_row(m, f"{r['expected_recompute']:,.1f}", shown)
    console.print(table)


def _plot_plan(path: Path, w, plans: dict[str, list[int]]) -> None:  # type: ignore[no-untyped-def]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    ax.fill_between(range(len(w)), w / max(w.sum(), 1e-12), step="mid", alpha=0.4, label="overlap-depth weight")
    for k, (m, pos) in enumerate(plans.items()):
        ax.scatter(pos, [-(k + 1) * 0.02 * max(w / max(w.sum(), 1e-12))] * len(pos), marker="|", s=80, label=m)
    ax.set_xlabel("depth t (tokens)")
    ax.set_ylabel("weight")
    ax.legend(fontsize=7)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except (OSError, ValueError) as exc:  # an unwritable path, or a suffix matplotlib has no writer for
        raise KVStateError(f"--plot {str(path)!r} cannot be written ({exc}); pass a writable .png path") from None
    finally:
        plt.close(fig)


def _fail(message: str) -> None:
    # one line, written directly: a Rich console would wrap it at the terminal width
    sys.stderr.write("error: " + " ".join(message.split()) + "\n")
    sys.stderr.flush()
    sys.exit(2)


def main(argv: list[str] | None = None) -> None:
    """Entry point: usage errors and :class:`KVStateError` become one line on stderr and exit code 2."""
    args = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in args[: next((i for i, a in enumerate(args) if not a.startswith("-")), len(args))]
    try:
        code = app(args=args, prog_name="kvstate", standalone_mode=False)
    except click_exc.NoArgsIsHelpError as exc:
        exc.show()  # bare `kvstate`: the help text
        sys.exit(2)
    except click_exc.ClickException as exc:  # bad option, missing argument, wrong type: click's own message
        if debug:
            raise
        where = f" (see {exc.ctx.command_path} --help)" if getattr(exc, "ctx", None) is not None else ""
        _fail(exc.format_message() + where)
    except typer.Abort:
        sys.stderr.write("aborted\n")
        sys.exit(130)
    except KVStateError as exc:
        if debug or _state["debug"]:
            raise
        _fail(str(exc))
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
