"""Report part: the real model behind ``kvstate serve`` (cache on / off) and HuggingFace's ``transformers serve`` under
GuideLLM (:mod:`kvstate.lab.models.serve_peer`; sparse prefix caching, ``docs/techniques.md#position``).

Reads the committed ``models/smollm2/serve_peer.json`` (a missing or stale file shows the command that writes it):
a table server × concurrency (TTFT p50 / p99, output tokens/s, inter-token latency, prompt tokens restored from the
cache; medians over the interleaved repeats with their spread), a figure of TTFT p50 and output tokens/s per server
and concurrency, and one headline row per target the run decided.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvstate.lab.experiment import headline_fields
from kvstate.lab.provenance import Artifact, load_artifact
from kvstate.lab.report import plots
from kvstate.lab.report.html import Figure, HeadlineRow, Table, artifact_row

FILE = "serve_peer.json"
COMMAND = "OMP_NUM_THREADS=1 python -m kvstate.lab.models.serve_peer --seed SEED --out models/smollm2/serve_peer.json"
WHERE = "real model: kvstate serve vs transformers serve"


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    k = len(s) // 2
    return s[k] if len(s) % 2 else (s[k - 1] + s[k]) / 2


def _runs(row: dict[str, Any]) -> list[dict[str, Any]]:
    extra = row.get("extra") or {}
    return [extra[k] for k in sorted(extra) if k.startswith("r") and isinstance(extra[k], dict)]


def _spread(xs: list[float], scale: float = 1.0, fmt: str = "{:.0f}") -> str:
    if not xs:
        return "—"
    return f"{fmt.format(_median(xs) * scale)} [{fmt.format(min(xs) * scale)}–{fmt.format(max(xs) * scale)}]"


def _figure(rows: list[dict[str, Any]], out_dir: Path) -> Figure | None:
    methods = [r["method"] for r in rows]
    if not methods:
        return None
    fig, axes = plots.figure(0.9, 3.2, ncols=2)
    for ax, key, scale, label in ((axes[0][0], "ttft_p50_s", 1e3, "TTFT p50 (ms, log)"),
                                  (axes[0][1], "output_tok_s", 1.0, "output tokens/s")):
        ys, lo, hi = [], [], []
        for r in rows:
            xs = [float(x[key]) * scale for x in _runs(r) if x.get(key) is not None]
            m = _median(xs) if xs else 0.0
            ys.append(m)
            lo.append(m - (min(xs) if xs else 0.0))
            hi.append((max(xs) if xs else 0.0) - m)
        ax.bar(range(len(methods)), ys, yerr=[lo, hi], capsize=3,
               color=[plots.color(m.split("@")[0]) for m in methods])
        ax.set_xticks(range(len(methods)), methods, rotation=35, ha="right", fontsize=7)
        ax.set_ylabel(label)
        if key == "ttft_p50_s":
            ax.set_yscale("log")
    name = plots.save(fig, out_dir, "smollm2_serve_peer.png")
    return Figure("SmolLM2 served three ways under GuideLLM (2K shared prefix): TTFT p50 and output tokens/s", name,
                  "medians over the interleaved repeats; bars span min–max.")


def build(res: Path, out_dir: Path) -> tuple[list[Table], list[Figure], list[HeadlineRow], Artifact, str]:
    """Tables, figures, headline rows, the artifact and a one-sentence finding for the section."""
    art = load_artifact(res / FILE, COMMAND)
    if art.run is None:
        row = artifact_row(art, WHERE, "cached TTFT p50 <= 1/2 uncached at a 2K shared prefix, c = 1 and c = 8; "
                           "TTFT and tokens/s against transformers serve", "")
        return [], [], [row], art, ""
    rows = list(art.run.get("rows") or [])
    table_rows = []
    for r in rows:
        runs = _runs(r)

        def col(key: str, scale: float = 1.0, fmt: str = "{:.0f}", runs: list[dict[str, Any]] = runs) -> str:
            return _spread([float(x[key]) for x in runs if x.get(key) is not None], scale, fmt)

        table_rows.append([r["method"], col("ttft_p50_s", 1e3), col("ttft_p99_s", 1e3), col("output_tok_s", 1, "{:.1f}"),
                           col("itl_p50_s", 1e3), col("reused_tokens"), len(runs)])
    load = (art.run.get("provenance") or {}).get("settings", {}).get("load", {})
    tables = [Table("The real model served three ways under GuideLLM: a 2,048-token shared prefix (primed once), "
                    f"{load.get('prompt_tokens', 64)} fresh tokens, {load.get('output_tokens', 32)} output tokens; "
                    "server@concurrency", ["server@c", "TTFT p50 ms", "TTFT p99 ms", "output tok/s", "ITL p50 ms",
                                           "prompt tokens restored", "repeats"], table_rows,
                    "median [min–max] over interleaved repeats, one GuideLLM run each; one thread per server, fp32; "
                    f"greedy replies of the three servers agree: {art.run.get('servers_agree')}")]
    headline: list[HeadlineRow] = []
    finding = []
    for d in [*(art.run.get("decisions") or []), *((art.run.get("per_token") or {}).get("decisions") or [])]:
        measured = f"{d['value']:.2f}× [{d['ci'][0]:.2f}, {d['ci'][1]:.2f}]"
        headline.append(artifact_row(art, WHERE, d["label"], measured, **headline_fields(d)))
        finding.append(f"{d['label']}: {measured} ({d['status']})")
    figures = [f for f in [_figure(rows, out_dir)] if f is not None]
    return tables, figures, headline, art, "Against transformers serve — " + "; ".join(finding) + "."


__all__ = ["build"]
