"""``kvstate transfer ...``: calibrate an SCD codec, benchmark the registered methods, write cards.

Semantic Cache Distillation (*Semantic Cache Distillation: Efficient State Transfer via Reuse and
Selective Patching*, ``docs/techniques.md#across-models``). ``serve``, ``generate`` and ``methods`` come
from the library (:mod:`kvstate.transfer.cli`: serving a transfer needs no lab). torch / transformers load
lazily inside the commands.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from kvstate.errors import KVStateError
from kvstate.transfer.cli import DEFAULT_CODEC, positions, register_commands

app = typer.Typer(no_args_is_help=True, help="State transfer across models: Semantic Cache Distillation (SCD).")
console = Console()
register_commands(app)


def _threads(n: int) -> None:
    from kvstate.lab.cli_output import set_threads

    set_threads(n)


def _patch(value: str) -> int | None:
    if value == "auto":
        return None
    if re.fullmatch(r"[0-9]+", value) is None:  # ASCII digits: isdigit() takes "²", which int() refuses
        raise KVStateError(f"--patch {value!r} must be 'auto' or a layer count k >= 0")
    return int(value)


@app.command("calibrate")
def calibrate_command(
    producer: Annotated[Path, typer.Option("--producer", help="Producer model directory (prefills).")],
    consumer: Annotated[Path, typer.Option("--consumer", help="Consumer model directory (decodes).")],
    out: Annotated[Path, typer.Option("--out", help="Codec directory to write.")],
    prefixes: Annotated[int, typer.Option("--prefixes", help="Calibration prefixes (a quarter held out).")] = 24,
    length: Annotated[int, typer.Option("--length", help="Tokens per prefix.")] = 512,
    rank_k: Annotated[int, typer.Option("--rank-k", help="Key code channels per KV head.")] = 16,
    rank_v: Annotated[int, typer.Option("--rank-v", help="Value code channels per KV head.")] = 32,
    rank_h: Annotated[int, typer.Option("--rank-h", help="H_in code channels per PATCH layer.")] = 64,
    patch: Annotated[str, typer.Option("--patch", help="PATCH layers: 'auto' or a count k.")] = "auto",
    bits: Annotated[int, typer.Option("--bits", help="Code precision on the wire: 8, 4, 16 or 32.")] = 8,
    reuse_map: Annotated[str, typer.Option("--reuse-map", help="REUSE maps: 'joint' (producer principal code, "
                                           "orthogonal decoder into the consumer); ablations 'regress' (reduced-rank "
                                           "regression) and 'pca' (the producer's own subspace).")] = "joint",
    patch_map: Annotated[str, typer.Option("--patch-map", help="PATCH H_in maps: 'regress' (reduced-rank "
                                           "regression + MLP residual) or 'joint' (the REUSE-style orthogonal "
                                           "decoder, an ablation).")] = "regress",
    seed: Annotated[int, typer.Option("--seed", min=0, help="Seed of the calibration prefixes.")] = 7919,
    threads: Annotated[int, typer.Option("--threads", help="torch CPU threads.")] = 1,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Write into an --out directory that already holds files.")] = False,
) -> None:
    """Fit REUSE maps and PATCH aligners on paired prefixes; choose the transition layers; save the codec."""
    from kvstate.io_safety import check_not_input, check_output_dir
    from kvstate.lab.harness import load_reference
    from kvstate.lab.progress import progress_bar
    from kvstate.lab.transfer.prompts import calibration_prompts
    from kvstate.transfer.calibrate import CalibrationConfig, calibrate_on
    from kvstate.transfer.codec import MANIFEST, WEIGHTS, CodecConfig, is_codec_dir
    from kvstate.transfer.states import geometry

    _threads(threads)
    cfg = CalibrationConfig(rank_k=rank_k, rank_v=rank_v, rank_h=rank_h, patch=_patch(patch), bits=bits,
                            prefixes=prefixes, length=length, seed=seed, reuse_map=reuse_map,
                            patch_map=patch_map)
    check_not_input(out, {"--producer": producer, "--consumer": consumer})
    check_output_dir(out, overwrite=overwrite, accept=is_codec_dir, kind=f"a codec directory ({WEIGHTS} + {MANIFEST})")
    limit = positions(producer, consumer)
    if limit is not None and length > limit:
        raise KVStateError(f"--length {length:,} exceeds the models' max_position_embeddings={limit:,}; pass "
                           f"--length <= {limit:,}")
    p, tok = load_reference(producer)
    c, _ = load_reference(consumer)
    CodecConfig(cfg.rank_k, cfg.rank_v, cfg.rank_h, (), cfg.bits).check(geometry(p))  # before the progress bar
    prompts = calibration_prompts(tok, cfg)
    n_hold = max(1, len(prompts) // 4)
    total = (len(prompts) - n_hold) + p.config.num_hidden_layers + n_hold
    with progress_bar("calibrate", total, unit="steps") as bar:
        codec = calibrate_on(p, c, prompts, cfg, progress=lambda s: (bar.note(s), bar.advance()))
    codec.save(out)
    info = codec.info
    table = Table(title=f"codec {out}: patch layers {list(codec.config.patch_layers)}")
    for col in ("layer", "raw drift K/V", "REUSE err K/V", "PATCH err K/V", "KL raw/REUSE/PATCH (this layer)"):
        table.add_column(col, justify="right")
    for i in range(codec.geometry.n_layers):
        table.add_row(str(i), f"{info['raw_drift_k'][i]:.3f} / {info['raw_drift_v'][i]:.3f}",
                      f"{info['reuse_err_k'][i]:.3f} / {info['reuse_err_v'][i]:.3f}",
                      f"{info['patch_err_k'][i]:.3f} / {info['patch_err_v'][i]:.3f}",
                      f"{info['impact_raw'][i]:.4f} / {info['impact_reuse'][i]:.4f} / {info['impact_patch'][i]:.4f}")
    console.print(table)
    console.print(f"next-token KL vs the consumer, all layers: {info['kl_all_layers']}")


# the source a transfer bench depends on: a change here makes committed bench.json files stale
BENCH_CODE = ("transfer", "models", "lab/transfer/bench.py", "lab/transfer/prompts.py", "lab/decode.py",
              "lab/perplexity.py", "lab/scoring.py", "lab/workloads/tasks.py", "lab/protocol.py", "lab/stats.py",
              "lab/experiment.py")


@app.command("bench")
def bench_command(
    producer: Annotated[Path, typer.Option("--producer", help="Producer model directory.")] = Path("models/ref-attn"),
    consumer: Annotated[Path, typer.Option("--consumer", help="Consumer model directory (default: the shifted pair's; "
                                           "models/ref-attn-ft with its codec is the near-aligned control).")
                        ] = Path("models/ref-attn-ft2"),
    codec_dir: Annotated[Path, typer.Option("--codec", help="Codec directory.")] = DEFAULT_CODEC,
    n: Annotated[int, typer.Option("--n", min=1, help="Examples per needle task and length.")] = 10,
    seed: Annotated[int, typer.Option("--seed", min=0, help="Seed of the evaluation items.")] = 0,
    lengths: Annotated[str, typer.Option("--length", help="Context lengths in tokens, comma-separated (default: 1K / 2K, "
                                         "the lengths of every committed quality run; the consumer solves nothing "
                                         "at 4K / 8K).")
                       ] = "1024,2048",
    methods: Annotated[str | None, typer.Option("--methods", help="Registered methods to run, comma-separated "
                                                "(default: all; the oracle always runs); `kvstate transfer methods` "
                                                "lists them.")] = None,
    ppl_n: Annotated[int, typer.Option("--ppl-n", help="Held-out text examples for perplexity.")] = 4,
    weak_n: Annotated[int, typer.Option("--weak-n", help="Examples per weak task (vt, fwe, cwe, qa).")] = 3,
    ablation_n: Annotated[int, typer.Option("--ablation-n", help="Examples per task for the key-vs-value rank "
                                            "ablation (0: skip).")] = 3,
    pca_codec: Annotated[Path | None, typer.Option(
        "--pca-codec", help="A codec calibrated with --reuse-map pca for the same pair: adds the reuse_pca_producer "
        "ablation row.")] = None,
    budget_rows: Annotated[bool, typer.Option("--budget/--no-budget", help="The methods' extended rows (SCD's PATCH "
                                              "budget scd_k1..scd_k4).")] = True,
    out: Annotated[Path | None, typer.Option(
        "--out", help="Append this run, with its provenance, to a result file (e.g. CODEC/bench.json).")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Start the --out file afresh (drop its runs).")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON document (the table goes to stderr).")] = False,
    threads: Annotated[int, typer.Option("--threads", help="torch CPU threads.")] = 1,
) -> None:
    """Every registered transfer method (and its extra rows) on the same prompts: quality pooled over the tasks the
    oracle solves, with intervals and the excluded tasks beside; perplexity; payload bytes per token; the consumer
    layers each recomputes. One row per method and length."""
    import sys
    from dataclasses import asdict

    from kvstate.lab.cli_output import check_results_out, print_json, table_console, write_results
    from kvstate.lab.experiment import preflight, recorder
    from kvstate.lab.harness import MAX_EXAMPLES, check_lengths_fit, load_reference
    from kvstate.lab.journal import open_journal
    from kvstate.lab.lists import parse_ints, parse_names
    from kvstate.lab.progress import progress_bar
    from kvstate.lab.transfer.bench import BenchConfig, plan, run_bench
    from kvstate.models.loading import load_config
    from kvstate.transfer import methods as registry
    from kvstate.transfer.codec import Codec

    _threads(threads)
    chosen = tuple(parse_names(methods, "--methods", registry.names())) if methods else ()
    cfg = BenchConfig(n=n, seed=seed, lengths=tuple(parse_ints(lengths, "--length", lo=64, example="1024,2K")),
                      ppl_n=ppl_n, weak_n=weak_n, ablation_n=ablation_n, budget_rows=budget_rows, methods=chosen)
    for option, value in (("--n", n), ("--ppl-n", ppl_n), ("--weak-n", weak_n), ("--ablation-n", ablation_n)):
        if not (1 if option == "--n" else 0) <= value <= MAX_EXAMPLES:
            raise KVStateError(f"{option} {value} must be in {1 if option == '--n' else 0}..{MAX_EXAMPLES:,}")
    if out is not None:
        check_results_out(out, overwrite=overwrite)
    codec = Codec.load(codec_dir)  # a wrong --codec first: it names the fix
    check_lengths_fit(load_config(consumer), cfg.lengths)  # the configs alone: before reading the weights
    check_lengths_fit(load_config(producer), cfg.lengths)
    # the experiment as asked (methods named CODEC:METHOD, so the seed ledger tells the pairs apart): its recorder
    # is the run's provenance, and the ledger and --out are checked before any weight is read
    planned = plan(cfg, codec_dir.name, BENCH_CODE, [producer, consumer, codec_dir, *([pca_codec] if pca_codec else [])],
                   {"ppl_n": ppl_n, "weak_n": weak_n, "ablation_n": ablation_n, "budget_rows": budget_rows})
    rec = recorder(planned)
    if out is not None:
        preflight(out, rec.finish())
    pca = Codec.load(pca_codec) if pca_codec is not None else None
    p, tok = load_reference(producer)
    c, _ = load_reference(consumer)
    # a recorded run is resumable: finished units are journaled beside the result file
    journal = open_journal(out, {"config": asdict(cfg), "threads": threads, "models": [
        str(producer), str(consumer), str(codec_dir), str(pca_codec)]}, BENCH_CODE,
        [producer, consumer, codec_dir, *([pca_codec] if pca_codec else [])], lambda s: print(s, file=sys.stderr))
    total = len(cfg.tasks) * len(cfg.lengths) * n + len(cfg.weak_tasks) * weak_n + ppl_n + (4 if ablation_n else 0)
    with progress_bar("bench", total, unit="ex") as bar:
        result = run_bench(p, c, tok, codec, cfg, tick=lambda s: (bar.note(s), bar.advance()), pca_codec=pca,
                           journal=journal, codec_dir=codec_dir, experiment=planned)
    result.update(producer=str(producer), consumer=str(consumer), codec=str(codec_dir),
                  pca_codec=str(pca_codec) if pca_codec else None)
    prov = rec.finish() if journal is None else journal.stamp(rec.finish())
    if out is not None:
        write_results(out, result, prov, overwrite=overwrite)
        if journal is not None:
            journal.close()
    table = Table(title=f"transfer bench: {producer} -> {consumer}, n={n}, lengths {lengths}")
    for col in ("method", "length", "n", "score [95% CI] (solved tasks)", "F1", "ppl", "B/token", "recomputed",
                "consumer ms"):
        table.add_column(col, justify="right")
    for r in result["results"]:
        shown = "no solved task" if r["score"] is None else f"{r['score']:.3f} [{r['score_ci'][0]:.3f}, {r['score_ci'][1]:.3f}]"
        table.add_row(r["method"], str(r["length"]), str(r["n"]), shown, f"{r['f1']:.3f}",
                      "" if r["ppl"] is None else f"{r['ppl']:.3f}", f"{r['payload_bytes_per_token']:.1f}",
                      ",".join(map(str, r["recomputed_layers"])), f"{r['consumer_ms']:.1f}")
    excluded = {f"{k}@{r['length']}": v for r in result["results"] if r["method"] == result["reference"]
                for k, v in r["excluded_tasks"].items()}
    if excluded:
        table.caption = "excluded (oracle < 0.9 there): " + ", ".join(f"{k} {v:.2f}" for k, v in excluded.items())
    table_console(as_json).print(table)
    if as_json:
        print_json({**result, "provenance": prov})


@app.command("profile")
def profile_command(
    method: Annotated[str, typer.Option("--method", help="A registered method that trains an artifact "
                                        "(`kvstate transfer methods`).")],
    out: Annotated[Path, typer.Option("--out", help="Directory that keeps the artifact (METHOD.safetensors) and "
                                      "its profile (METHOD.json); created if absent.")],
    producer: Annotated[Path, typer.Option("--producer", help="Producer model directory.")] = Path("models/ref-attn"),
    consumer: Annotated[Path, typer.Option("--consumer", help="Consumer model directory.")] = Path("models/ref-attn-ft2"),
    codec_dir: Annotated[Path, typer.Option("--codec", help="Codec directory.")] = DEFAULT_CODEC,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an artifact kept there before.")] = False,
    threads: Annotated[int, typer.Option("--threads", help="torch CPU threads.")] = 1,
) -> None:
    """Profile one method on the codec's calibration stream (dev data; the bench's own profiling, kept): its trained
    artifact goes to OUT/METHOD.safetensors and what the profile chose (options, info) to OUT/METHOD.json, so a
    producer (`kvstate transfer serve --option artifact=...`) and the TTFT grid can use the same artifact later."""
    import json
    import shutil

    from kvstate.io_safety import write_bytes_atomic, write_text_atomic
    from kvstate.lab.harness import load_reference
    from kvstate.lab.provenance import Recorder
    from kvstate.lab.transfer.bench import profile_prompts
    from kvstate.transfer import methods as registry
    from kvstate.transfer.codec import Codec

    _threads(threads)
    m = registry.get(method)
    art, info_path = out / f"{method}.safetensors", out / f"{method}.json"
    if out.exists() and not out.is_dir():
        raise KVStateError(f"--out {str(out)!r} is a file; pass a directory")
    for f in (art, info_path):
        if f.exists() and not overwrite:
            raise KVStateError(f"--out {str(out)!r} already keeps {f.name}; pass --overwrite to replace it")
    codec = Codec.load(codec_dir)
    rec = Recorder(code=("transfer", "lab/transfer/bench.py", "lab/transfer/prompts.py"),
                   models=[producer, consumer, codec_dir], settings={"method": method})
    p, tok = load_reference(producer)
    c, _ = load_reference(consumer)
    ctx = registry.MethodContext(codec=codec, codec_dir=codec_dir)
    prompts = profile_prompts(tok, ctx, max(4, m.calibration_prefixes))
    console.print(f"[dim]profiling {method} on {len(prompts)} calibration prefixes ...[/]")
    opts, info = m.profile(p, c, prompts, ctx)
    files = {k: Path(v) for k, v in opts.items() if Path(v).is_file()}
    if not files:
        raise KVStateError(f"--method {method} trains no artifact (its profile chose {opts or 'nothing'}); it needs "
                           "no `kvstate transfer profile`")
    if len(files) > 1:
        raise KVStateError(f"--method {method}'s profile wrote {len(files)} files ({', '.join(files)}); one expected")
    out.mkdir(parents=True, exist_ok=True)
    (key, src), = files.items()
    write_bytes_atomic(art, src.read_bytes())
    shutil.rmtree(src.parent, ignore_errors=True) if src.parent.name.startswith("kvstate-") else None
    doc = {"method": method, "options": {**opts, key: str(art)}, "info": info, "prefixes": len(prompts),
           "producer": str(producer), "consumer": str(consumer), "codec": str(codec_dir),
           "provenance": rec.finish()}
    write_text_atomic(info_path, json.dumps(doc, indent=1, default=str) + "\n")
    console.print(f"{method}: {key}={art}; {json.dumps(info, default=str)[:300]}")


TTFT_CODE = ("transfer", "models", "lab/netns.py", "lab/transfer/ttft.py", "lab/transfer/bench.py",
             "lab/transfer/cli.py")


@app.command("ttft")
def ttft_command(
    producer: Annotated[Path, typer.Option("--producer", help="Producer model directory.")] = Path("models/ref-attn"),
    consumer: Annotated[Path, typer.Option("--consumer", help="Consumer model directory.")] = Path("models/ref-attn-ft2"),
    codec_dir: Annotated[Path, typer.Option("--codec", help="Codec directory.")] = DEFAULT_CODEC,
    rate: Annotated[str, typer.Option("--rate", help="Shaped link rates, Gbit/s, comma-separated ('none': only "
                                      "--unshaped).")] = "0.1,1,10",
    lengths: Annotated[str, typer.Option("--length", help="Prompt tokens, comma-separated.")] = "1K,4K,8K",
    repeats: Annotated[int, typer.Option("--repeats", help="Prompts per length, interleaved (>= 5 for a timing "
                                         "result).")] = 5,
    methods: Annotated[str | None, typer.Option("--methods", help="Registered methods that ship a payload, "
                                                "comma-separated (default: all).")] = None,
    options: Annotated[str, typer.Option("--options", help="Per-method options: 'auto' (what the bench's profiling "
                                         "chose, from CODEC/bench.json), 'none' (defaults) or METHOD.KEY=VALUE,...")
                       ] = "auto",
    seed: Annotated[int, typer.Option("--seed", min=0, help="Seed of the prompts.")] = 0,
    unshaped: Annotated[bool, typer.Option("--unshaped", help="Also measure plain loopback (no namespace).")] = False,
    out: Annotated[Path | None, typer.Option("--out", help="Append the run, with its provenance, to this result file "
                                             "(e.g. CODEC/ttft.json).")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Start the --out file afresh.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON document (the table goes to stderr).")] = False,
) -> None:
    """Time to first token end to end over a kernel-shaped link: producer (`kvstate transfer serve`, one process per
    method) and consumer in a private network namespace per rate; cold, warm (payload in the store) and the oracle
    (the consumer's own prefill), interleaved repeats. Shaped rates need network namespaces (root); where they are
    not permitted they are listed as skipped, never estimated."""
    from kvstate.lab.cli_output import check_results_out, print_json, table_console, write_results
    from kvstate.lab.experiment import preflight
    from kvstate.lab.lists import parse_floats, parse_ints, parse_names
    from kvstate.lab.provenance import Recorder
    from kvstate.lab.transfer.ttft import TTFTConfig, method_options, run_ttft
    from kvstate.transfer import methods as registry

    chosen = tuple(parse_names(methods, "--methods", registry.served_methods())) if methods else ()
    rates = () if rate == "none" else tuple(parse_floats(rate, "--rate", lo=0.0, lo_open=True, example="0.1,1,10"))
    cfg = TTFTConfig(rates_gbit=rates, lengths=tuple(parse_ints(lengths, "--length", lo=2, example="1K,4K")),
                     repeats=repeats, seed=seed, unshaped=unshaped, methods=chosen,
                     options=method_options(options, codec_dir, chosen or registry.served_methods()))
    rec = Recorder(code=TTFT_CODE, models=[producer, consumer, codec_dir], n=cfg.repeats, seeds=[cfg.seed],
                   lengths=cfg.lengths, settings={"rates_gbit": list(cfg.rates_gbit), "methods": list(cfg.method_list),
                                                  "unshaped": cfg.unshaped, "threads": 1, "options": cfg.options})
    if out is not None:
        check_results_out(out, overwrite=overwrite)
        preflight(out, rec.finish())  # a seed the ledger refuses: now, not after the measuring
    err = Console(stderr=True)
    result = run_ttft(cfg, producer, consumer, codec_dir, log=lambda s: err.print(f"[dim]{s}[/]"))
    prov = rec.finish()
    if out is not None:
        write_results(out, result, prov, overwrite=overwrite)
    for key, why in result["skipped"].items():
        err.print(f"[yellow]rate {key} Gbit/s skipped: {why}[/]")
    if result["rows"]:
        table_console(as_json).print(ttft_table(result))
    if as_json:
        print_json({**result, "provenance": prov})


def ttft_table(result: dict) -> Table:  # type: ignore[type-arg]
    keys = [*result["links"]]
    t = Table(title="time to first token, ms (median cold / warm; oracle: own prefill)")
    for col in ("method", "length", "B/token", *(f"{k} Gbit/s" if k != "loopback" else k for k in keys), "agrees"):
        t.add_column(col, justify="right")
    for r in result["rows"]:
        cells = []
        for k in keys:
            c = r["ttft_ms"][k]
            cells.append(f"{c['cold']:.1f}" if "payload_bytes" not in r else f"{c['cold']:.1f} / {c['warm']:.1f}")
        t.add_row(r["method"], str(r["length"]), f"{r.get('payload_bytes_per_token', 0):.1f}", *cells,
                  f"{r['first_token_agrees']:.2f}" if "first_token_agrees" in r else "")
    t.caption = "; ".join(f"{k}: {'unshaped' if v['rate_gbit'] is None else 'set ' + str(v['rate_gbit'])}, achieved "
                          f"{v['achieved_gbit_s']:.3f} Gbit/s" for k, v in result["links"].items())
    return t


@app.command("card")
def card_command(
    model: Annotated[Path | None, typer.Option("--model", help="The fine-tuned consumer directory.")] = None,
    base: Annotated[Path | None, typer.Option("--base", help="The model it was fine-tuned from.")] = None,
    bench: Annotated[Path | None, typer.Option("--bench", help="kvstate transfer bench JSON to quote.")] = None,
    command: Annotated[str | None, typer.Option("--command", help="The fine-tune / calibrate command, quoted in the card.")] = None,
    codec_dir: Annotated[Path | None, typer.Option("--codec", help="Write CODEC/README.md instead (from its manifest).")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing README.md.")] = False,
) -> None:
    """Write MODEL/README.md for a fine-tuned consumer (--model, --base) from its run and the transfer bench, or a
    codec's card (--codec); always with the --command that made it. An existing README.md is replaced only with
    --overwrite."""
    from kvstate.integrity import artifact_kind
    from kvstate.io_safety import write_text_atomic
    from kvstate.lab.cli_output import check_out_file
    from kvstate.lab.transfer.card import codec_card, consumer_card

    if codec_dir is not None and (model is not None or base is not None or bench is not None):
        raise KVStateError("transfer card: pass --codec DIR alone, or --model DIR --base DIR [--bench FILE]")
    if codec_dir is None and (model is None or base is None):
        raise KVStateError("transfer card: pass --model DIR --base DIR (the consumer and the model it was fine-tuned "
                           "from), or --codec DIR; nothing is written to a default path")
    if not command or not command.strip():
        raise KVStateError("transfer card: pass --command '...' (the fine-tune / calibrate command the card quotes)")
    if bench is not None and not bench.is_file():
        raise KVStateError(f"--bench {str(bench)!r} is not a file; pass a kvstate transfer bench result file")
    for option, d, kind in (("--codec", codec_dir, "codec"), ("--model", model, "model"), ("--base", base, "model")):
        if d is not None and artifact_kind(d) != kind:
            raise KVStateError(f"transfer card: {option} {str(d)!r} is not a {kind} directory; pass one")
    if codec_dir is not None:
        path = check_out_file(codec_dir / "README.md", overwrite=overwrite, option="transfer card")
        write_text_atomic(path, codec_card(codec_dir, command))
        console.print(f"wrote {path}")
        return
    assert model is not None and base is not None
    path = check_out_file(model / "README.md", overwrite=overwrite, option="transfer card")
    write_text_atomic(path, consumer_card(model, base, bench, command))
    console.print(f"wrote {path}")
