"""Benchmark: time to first token of cross-model state transfer, measured end to end over a shaped link.

Producer (``kvstate transfer serve --method M``, one process per method) and consumer (this run's child
process) talk over loopback inside a private network namespace whose ``lo`` the kernel rate-limits
(``tc qdisc ... tbf``) at each ``--rate``; the rate a bulk transfer actually achieves is reported next to
it. Per prompt length, ``--repeats`` prompts, interleaved: cold (producer prefill + encode + wire +
consumer decode + first token), warm (the payload already in the Redis store) and the oracle (the
consumer's own prefill + first token). See :mod:`kvstate.lab.transfer.ttft`. Where namespaces are not
permitted (not root), the shaped rates are listed under ``skipped`` with the reason; ``--unshaped`` adds
plain loopback, measured in this namespace.

Prints a table on stderr, then one JSON line on stdout; ``--out FILE`` appends the run with its provenance
(rows keyed by method and length, the shape of ``kvstate transfer bench --json`` rows).
Methods are the registry's (:mod:`kvstate.transfer.methods`; default: every one that ships a payload), each
served with the options its offline profiling chose (``--options auto``: the newest run of ``CODEC/bench.json``).
Usage: ``python benchmarks/transfer_ttft.py [--producer models/ref-attn] [--consumer models/ref-attn-ft2]
[--codec models/codec-ref-attn-ft2] [--rate 0.1,1,10 | none] [--length 1K,4K,8K] [--repeats 5]
[--methods raw,kivi4,...] [--options auto | none | METHOD.KEY=VALUE,...] [--unshaped] [--out FILE [--overwrite]]``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvstate.lab.cli_output import check_results_out, write_results
from kvstate.lab.lists import parse_floats, parse_ints, parse_names
from kvstate.lab.provenance import Recorder, read_runs
from kvstate.lab.transfer.ttft import TTFTConfig, run_ttft
from kvstate.transfer import methods as registry

# the source the measurement depends on
CODE = ("transfer", "models", "lab/netns.py", "lab/transfer/ttft.py", "lab/transfer/bench.py", "lab/transfer/cli.py")


def table(result: dict) -> Table:  # type: ignore[type-arg]
    keys = [*result["links"]]
    t = Table(title="time to first token, ms (median cold / warm; oracle: own prefill)")
    for col in ("method", "length", "B/token", *(f"{k} Gbit/s" if k != "loopback" else k for k in keys), "agrees"):
        t.add_column(col, justify="right")
    for r in result["rows"]:
        cells = []
        for k in keys:
            c = r["ttft_ms"][k]
            cells.append(f"{c['cold']:.1f}" if r["method"] == "oracle" else f"{c['cold']:.1f} / {c['warm']:.1f}")
        t.add_row(r["method"], str(r["length"]), f"{r.get('payload_bytes_per_token', 0):.1f}", *cells,
                  f"{r['first_token_agrees']:.2f}" if "first_token_agrees" in r else "")
    t.caption = "; ".join(f"{k}: {'unshaped' if v['rate_gbit'] is None else 'set ' + str(v['rate_gbit'])}, achieved "
                          f"{v['achieved_gbit_s']:.3f} Gbit/s" for k, v in result["links"].items())
    return t


def profiled_options(run: dict) -> dict[str, dict[str, str]]:  # type: ignore[type-arg]
    """The options each method's offline profiling chose in one bench run (``method_options``); a run written
    before methods were registered kept only DroidSpeak's block, as ``droidspeak_block`` [a, b]."""
    if isinstance(run.get("method_options"), dict):
        return {m: {k: str(v) for k, v in o.items()} for m, o in run["method_options"].items()}
    block = run.get("droidspeak_block")
    return {"droidspeak": {"block": f"{block[0]}:{block[1]}"}} if isinstance(block, list) and len(block) == 2 else {}


def method_options(value: str, codec_dir: Path) -> dict[str, dict[str, str]]:
    """``--options``: ``auto`` reads what the bench's profiling chose for this codec's pair (the newest run of
    ``CODEC/bench.json``; none there: every method's defaults), ``none`` is every method's defaults, else
    ``METHOD.KEY=VALUE`` pairs, comma-separated."""
    if value == "none":
        return {}
    if value == "auto":
        bench = codec_dir / "bench.json"
        runs = read_runs(bench) if bench.is_file() else []
        return profiled_options(runs[-1]) if runs else {}
    out: dict[str, dict[str, str]] = {}
    for part in filter(None, (x.strip() for x in value.split(","))):
        head, eq, v = part.partition("=")
        m, dot, key = head.partition(".")
        if not eq or not dot:
            raise registry.MethodError(f"--options {part!r} must be METHOD.KEY=VALUE (e.g. droidspeak.block=1:4), "
                                       "'auto' or 'none'")
        registry.get(m, option="--options")
        out.setdefault(m, {})[key] = v
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--producer", type=Path, default=Path("models/ref-attn"))
    ap.add_argument("--consumer", type=Path, default=Path("models/ref-attn-ft2"))
    ap.add_argument("--codec", type=Path, default=Path("models/codec-ref-attn-ft2"))
    ap.add_argument("--rate", default="0.1,1,10", help="shaped link rates, Gbit/s, comma-separated ('none': only "
                    "--unshaped)")
    ap.add_argument("--length", default="1K,4K,8K", help="prompt tokens, comma-separated")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--methods", default=None, help="registered methods, comma-separated (default: every one that "
                    "ships a payload)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--unshaped", action="store_true", help="also measure plain loopback (no namespace)")
    ap.add_argument("--out", type=Path, default=None, help="append the run, with its provenance, to this file")
    ap.add_argument("--overwrite", action="store_true", help="start the --out file afresh")
    ap.add_argument("--options", default="auto", help="per-method options: 'auto' (what the bench's profiling chose, "
                    "from the codec's bench.json), 'none' (defaults) or METHOD.KEY=VALUE,...")
    args = ap.parse_args(argv)
    rates = () if args.rate == "none" else tuple(parse_floats(args.rate, "--rate", lo=0.0, lo_open=True,
                                                               example="0.1,1,10"))
    cfg = TTFTConfig(rates_gbit=rates, lengths=tuple(parse_ints(args.length, "--length", lo=2, example="1K,4K")),
                     repeats=args.repeats, seed=args.seed, unshaped=args.unshaped,
                     methods=tuple(parse_names(args.methods, "--methods", registry.served_methods()))
                     if args.methods else (), options=method_options(args.options, args.codec))
    if args.out is not None:
        check_results_out(args.out, overwrite=args.overwrite)
    rec = Recorder(code=CODE, models=[args.producer, args.consumer, args.codec], n=cfg.repeats, seeds=[cfg.seed],
                   lengths=cfg.lengths, settings={"rates_gbit": list(cfg.rates_gbit), "methods": list(cfg.method_list),
                                                  "unshaped": cfg.unshaped, "threads": 1, "options": cfg.options})
    err = Console(stderr=True)
    result = run_ttft(cfg, args.producer, args.consumer, args.codec, log=lambda s: err.print(f"[dim]{s}[/]"))
    prov = rec.finish()
    if args.out is not None:
        write_results(args.out, result, prov, overwrite=args.overwrite)
    for key, why in result["skipped"].items():
        err.print(f"[yellow]rate {key} Gbit/s skipped: {why}[/]")
    if result["rows"]:
        err.print(table(result))
    sys.stdout.write(json.dumps({"benchmark": "transfer_ttft", **result, "provenance": prov}) + "\n")


if __name__ == "__main__":
    main()
