"""The ``kvstate`` command line: thin wrappers that parse arguments, call library functions and print.

Bad input (a missing model directory, a config that is not a causal LM, an unsupported family, a
malformed file) prints one clear message and exits with code 2; ``--debug`` shows the traceback.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from kvstate.errors import KVStateError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Manage the state an LLM carries between tokens.")
console = Console()
err = Console(stderr=True)
_state = {"debug": False}

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
        print(json.dumps(result.as_json()))
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
) -> None:
    """The main job: every technique's section on the embedded default models → DIR/index.html + summary.json."""
    from kvstate.report import build_report

    index = build_report(out, models_dir)
    console.print(f"report written: {index} and {out / 'summary.json'}")


def main() -> None:
    try:
        app()  # standalone: click handles usage errors itself (exit code 2)
    except KVStateError as exc:
        if _state["debug"]:
            raise
        err.print(f"[bold red]error:[/] {exc}")
        sys.exit(2)


if __name__ == "__main__":
    main()
