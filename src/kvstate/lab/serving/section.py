"""Report part: the server's scheduler at concurrency 1 and 8 (:mod:`kvstate.lab.serving.stall`'s committed run).

Continuous batching with chunked prefill (Sarathi-Serve's stall-free budget, ``docs/techniques.md``): the headline
rows are the loop's decisions for the server's default arm, one per target and workload, then the later visits
of a shared prefix at c = 8 and goodput at c = 8 (shares of requests, Wilson intervals); the table shows every
arm's medians beside them, so the other arm's trade-off is visible without counting toward the verdict.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from kvstate.lab import stats
from kvstate.lab.experiment import headline_fields
from kvstate.lab.provenance import load_artifact
from kvstate.lab.report.html import HeadlineRow, Table, artifact_row
from kvstate.lab.serving import peer_section

TECH = "serving (continuous batching, in-process)"
FILE = "ref-hybrid/stall.json"
COMMAND = "OMP_NUM_THREADS=1 python -m kvstate.lab.serving.stall --seed 1086 --out models/ref-hybrid/stall.json"
DEFAULT_ARM = "chunk512"  # kvstate serve's default (--max-prefill-while-decoding unset)
GOODPUT_SHARE, LATER_SHARE = 0.9, 0.95  # issue 46's targets
SHAPE_FILE = "ref-hybrid/shape45238.json"
SHAPE_COMMAND = ("OMP_NUM_THREADS=1 python -m kvstate.lab.serving.shape45238 --seed 1087 "
                 "--out models/ref-hybrid/shape45238.json")


def build(models_dir: Path) -> tuple[list[Table], list[HeadlineRow]]:
    tables, head = _stall(models_dir)
    shape_tables, shape_head = _shape(models_dir)
    peer_tables, peer_head = peer_section.build(models_dir)
    return tables + shape_tables + peer_tables, head + shape_head + peer_head


def _shape(models_dir: Path) -> tuple[list[Table], list[HeadlineRow]]:
    """vLLM #45238's workload (:mod:`kvstate.lab.serving.shape45238`): the loop's decisions, hits per method."""
    art = load_artifact(models_dir / SHAPE_FILE, SHAPE_COMMAND)
    if art.run is None:
        return [], [artifact_row(art, TECH, "vLLM #45238 shapes, c = 1: >= 60 / 64 hits", "")]
    run = art.run
    head = [artifact_row(art, TECH, str(d["label"]), f"{d['value'] * 64:.1f} / 64 [{d['ci'][0] * 64:.1f}, "
                         f"{d['ci'][1] * 64:.1f}]", **headline_fields(d)) for d in run.get("decisions") or []]
    rows = []
    for r in run["rows"]:
        restored, ttft = r["extra"]["restored"], r["extra"]["ttft_s"]
        rows.append([r["task"], r["method"], f"{int(sum(r['values']))} / {len(r['values'])}",
                     f"{statistics.median(restored):.0f}", f"{1e3 * statistics.median(ttft):.0f}"])
    prov = run.get("provenance", {})
    return [Table("vLLM #45238's workload on ref-hybrid: one shared prefix, a request-unique suffix, 64 requests "
                  "per stream at c = 1 (vLLM: 52 / 64 and 0 / 64 hits on these shapes)",
                  ["shape (shared-unique)", "method", "hits (>= 90% of the prefix restored)", "restored tokens p50",
                   "TTFT p50 ms"], rows,
                  note=f"Test seed {prov.get('seeds')}; `{prov.get('command', SHAPE_COMMAND)}`. grid-off: the prefix "
                       "cache without grid checkpoints; server: kvstate serve's defaults (grid block 256). The first "
                       "request of each stream is cold.")], head


def _stall(models_dir: Path) -> tuple[list[Table], list[HeadlineRow]]:
    art = load_artifact(models_dir / FILE, COMMAND)
    if art.run is None:
        return [], [artifact_row(art, TECH, "c = 8 against c = 1 on ref-hybrid: ITL, TTFT p99, tokens/s", "")]
    run = art.run
    head = []
    for d in run.get("decisions") or []:
        if not str(d["method"]).startswith(f"{DEFAULT_ARM}@"):
            continue
        shown = f"{d['value']:.2f}x [{d['ci'][0]:.2f}, {d['ci'][1]:.2f}]"
        if "output tokens/s" in str(d["label"]):  # decided on seconds per token; shown as the tokens/s ratio too
            shown = (f"{1 / d['value']:.2f}x tokens/s [{1 / d['ci'][1]:.2f}, {1 / d['ci'][0]:.2f}] (seconds per "
                     f"token {shown})")
        head.append(artifact_row(art, TECH, str(d["label"]), shown, **headline_fields(d)))
    for v in run.get("later_visits") or []:
        if v["method"] == f"{DEFAULT_ARM}@c8":
            head.append(artifact_row(
                art, TECH, f"later visits of a shared 1,024-token prefix at c = 8: >= {100 * LATER_SHARE:.0f}% "
                "restore >= 90% of it (empty cache per repeat, no declared boundaries)",
                f"{v['restoring_90pct']} / {v['visits']}", status=v["status"], ci=tuple(v["ci"]), n=v["visits"]))
    for g in run.get("goodput") or []:
        if g["method"] == f"{DEFAULT_ARM}@c8":
            head.append(artifact_row(
                art, TECH, f"goodput at c = 8, {g['task']}: >= {100 * GOODPUT_SHARE:.0f}% of requests with TTFT <= "
                "500 ms and mean ITL <= 50 ms", f"{g['share']:.2f} ({g['met']} / {g['requests']})",
                status=stats.decide(g["ci"][0], g["ci"][1], GOODPUT_SHARE), ci=tuple(g["ci"]), n=g["requests"]))
    return [_table(run)], head


def _table(run: dict[str, Any]) -> Table:
    rows = []
    for r in run["rows"]:
        reps = list(r["extra"].values())

        def med(key: str, reps: list[dict[str, Any]] = reps) -> float:
            return statistics.median(x[key] for x in reps)

        rows.append([r["task"], r["method"], f"{1e3 * med('itl_p50_s'):.1f}", f"{1e3 * med('ttft_p50_s'):.0f}",
                     f"{1e3 * med('ttft_p99_s'):.0f}", f"{med('output_tok_s'):.1f}", f"{med('goodput'):.2f}"])
    prov = run.get("provenance", {})
    return Table("The scheduler at c = 1 and 8 on ref-hybrid: closed-loop client in-process, 1,024-token prefixes "
                 "+ 64 fresh tokens, 32 output tokens", ["workload", "arm @ concurrency", "ITL p50 ms",
                                                         "TTFT p50 ms", "TTFT p99 ms", "output tok/s", "goodput"],
                 rows, note=f"Medians of {prov.get('settings', {}).get('repeats', '?')} interleaved repeats; test seed "
                            f"{prov.get('seeds')}; `{prov.get('command', COMMAND)}`. chunk512: the server's default; "
                            "stall64: --max-prefill-while-decoding 64 (a prefill that starts beside decodes runs in "
                            "64-token calls).")
