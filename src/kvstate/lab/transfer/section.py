"""Report section: state transfer across models — Semantic Cache Distillation against its baselines.

*Semantic Cache Distillation: Efficient State Transfer via Reuse and Selective Patching*
(``docs/techniques.md#across-models``). Reads the committed benchmark
``models/codec-ref-attn-ft/bench.json``, produced by::

    kvstate transfer bench --producer models/ref-attn --consumer models/ref-attn-ft \\
        --codec models/codec-ref-attn-ft --out models/codec-ref-attn-ft/bench.json

(measuring takes minutes, so the report reuses it): the method table (one row per method and length),
the payload-vs-quality plot, the PATCH-budget rows, the per-layer drift, and one headline row per target
with met / missed / undecided from paired intervals. Time to first token is measured by its own bench.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from kvstate.lab import stats
from kvstate.lab.provenance import Artifact, load_artifact
from kvstate.lab.report.html import Figure, HeadlineRow, Section, Table, artifact_row

PAPER = "Semantic Cache Distillation: Efficient State Transfer via Reuse and Selective Patching"

CODEC = "codec-ref-attn-ft"
TECHNIQUE = "across models (SCD)"
COMMAND = ("kvstate transfer bench --producer models/ref-attn --consumer models/ref-attn-ft "
           "--codec models/codec-ref-attn-ft --n 25 --ppl-n 200 --seed 1000 --out models/codec-ref-attn-ft/bench.json")


def pooled(bench: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per method, its rows over every length pooled: items in row order, bytes and scores averaged."""
    out: dict[str, dict[str, Any]] = {}
    for r in bench["results"]:
        p = out.setdefault(r["method"], {"items": [], "rows": []})
        p["items"] += r.get("items") or []
        p["rows"].append(r)
    for p in out.values():
        rows = p["rows"]
        for key in ("score", "f1", "payload_bytes_per_token"):
            p[key] = sum(r[key] for r in rows) / len(rows)
        p["ppl"] = rows[0].get("ppl")
    return out


def _paired(art: Artifact, what: str, a: dict[str, Any], b: dict[str, Any], factor: float, higher: bool) -> HeadlineRow:
    """``a >= factor x b`` (or ``<=``) decided by the paired interval of ``a - factor x b`` on the same items."""
    if a["items"] and len(a["items"]) == len(b["items"]):
        d = stats.paired_difference(a["items"], [factor * x for x in b["items"]])
        return artifact_row(art, TECHNIQUE, what, f"{a['score']:.3f} vs {b['score']:.3f}; difference {d.value:+.3f} "
                            f"(n = {d.n})", status=stats.decide(d.lo, d.hi, 0.0, higher_is_better=higher),
                            ci=(d.lo, d.hi), rate=True)
    ok = a["score"] >= factor * b["score"] if higher else a["score"] <= factor * b["score"]
    return artifact_row(art, TECHNIQUE, what, f"{a['score']:.3f} vs {b['score']:.3f}", bool(ok))


def targets(bench: dict[str, Any], art: Artifact) -> list[HeadlineRow]:
    """The targets of SCD with this benchmark's values (rows marked stale when the file is). Time to first token
    is measured over a shaped link by its own bench, not here."""
    by = pooled(bench)
    o, s, raw = by["oracle"], by["scd"], by["raw"]
    bpt = s["payload_bytes_per_token"]
    shrink = bench["fp16_raw_kv_bytes_per_token"] / bpt if bpt > 0 else float("nan")
    return [
        _paired(art, "premise: raw reuse <= 0.7 x the oracle (paired interval of raw - 0.7 x oracle)", raw, o, 0.7, False),
        _paired(art, "SCD score >= 95% of the oracle's (paired interval of SCD - 0.95 x oracle)", s, o, 0.95, True),
        artifact_row(art, TECHNIQUE, "payload >= 8x smaller than fp16 raw KV",
                     f"{shrink:.2f}x ({bpt:.0f} vs {bench['fp16_raw_kv_bytes_per_token']} B/token)", bool(shrink >= 8)),
    ]


def notes(bench: dict[str, Any]) -> list[str]:
    """Facts that cannot be missed: the baselines' measured quality."""
    by = pooled(bench)
    o, raw = by["oracle"], by["raw"]
    q4 = by.get("kivi4") or by.get("kv4bit") or raw
    return [f"raw reuse {raw['score']:.3f} / ppl {raw['ppl']:.2f}, 4-bit KV {q4['score']:.3f} / ppl {q4['ppl']:.2f}, "
            f"oracle {o['score']:.3f} / ppl {o['ppl']:.2f} (from the committed bench)"]


def pareto_figure(bench: dict[str, Any], out_dir: Path) -> Figure:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    by = pooled(bench)
    for ax, metric, label in ((axes[0], "score", "score (needle tasks)"), (axes[1], "ppl", "perplexity (lower is better)")):
        for m, p in by.items():
            x = max(p["payload_bytes_per_token"], 1.0)  # the oracle ships nothing: drawn at 1 B
            ax.plot([x], [p[metric]], marker="o", ls="", label=m)
        ax.set_xscale("log")
        ax.set_xlabel("payload bytes per token (oracle drawn at 1)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_dir / "transfer_pareto.png", dpi=100)
    plt.close(fig)
    return Figure("Payload size vs quality per method", "transfer_pareto.png",
                  "Payload bytes per token measured from the payloads sent; scores pooled over the lengths.")


def build(out_dir: Path, models_dir: Path) -> Section:
    path = models_dir / CODEC / "bench.json"
    sec = Section("transfer", "Across models: Semantic Cache Distillation", paper=PAPER)
    art = load_artifact(path, COMMAND)
    if art.run is None:
        sec.intro = f"No benchmark at {path}; produce it with `{COMMAND}`."
        sec.headline = [artifact_row(art, TECHNIQUE, "SCD targets", "")]
        return sec
    bench = art.run
    cfg = bench["config"]
    sec.intro = (f"Producer `{bench.get('producer')}` prefills; consumer `{bench.get('consumer')}` (fine-tuned from it) "
                 f"decodes. Codec ranks K/V/H_in {bench['ranks']}, {bench['bits']}-bit codes, PATCH layers "
                 f"{bench['patch_layers']} (REUSE map {bench.get('reuse_map')}); DroidSpeak block "
                 f"{bench['droidspeak_block']}. n = {cfg['n']} per needle task "
                 f"and length {cfg['lengths']}, seed {cfg['seed']}; perplexity on {cfg['ppl_n']} held-out texts of "
                 f"{cfg['ppl_length']} tokens. From `{path}` (`{COMMAND}`).")
    sec.tables.append(Table("Methods on the same prompts (one row per method and length)", [
        "method", "length", "n", "score", "95% CI", "F1", "ppl", "payload B/token", "consumer ms"],
        [[r["method"], r.get("length", ""), r.get("n", ""), r["score"], str(r.get("score_ci", "")), r["f1"], r["ppl"],
          r["payload_bytes_per_token"], r["consumer_ms"]] for r in bench["results"]]))
    per_task: dict[str, dict[str, Any]] = {}
    for r in bench["results"]:
        per_task.setdefault(r["method"], {}).update(r["per_task"])
    cells = list(next(iter(per_task.values())))
    sec.tables.append(Table("Score per task and length", ["method", *cells],
                            [[m, *(v.get(c, "") for c in cells)] for m, v in per_task.items()]))
    weak = list(bench["results"][0].get("weak_tasks", {}))
    if weak:
        sec.tables.append(Table("Weak tasks (the full cache scores poorly here; shown, not targeted)", ["method", *weak],
                                [[r["method"], *(r["weak_tasks"].get(c, "") for c in weak)] for r in bench["results"]
                                 if r.get("length", cfg["lengths"][0]) == cfg["lengths"][0]]))
    if bench.get("patch_budget"):
        by = pooled(bench)
        sec.tables.append(Table("PATCH budget k (the k layers with the largest calibrated patch gain; pooled over "
                                "lengths)", ["k", "layers", "score", "ppl", "B/token"],
                                [[b["k"], str(b["layers"]), round(by[b["method"]]["score"], 4), by[b["method"]]["ppl"],
                                  round(by[b["method"]]["payload_bytes_per_token"], 2)]
                                 for b in bench["patch_budget"] if b["method"] in by]))
    if bench.get("ablation_patch"):
        sec.tables.append(Table("PATCH budget k (layers by calibrated gain)", ["k", "layers", "score", "ppl", "B/token"],
                                [[a["k"], str(a["layers"]), a["score"], a["ppl"], a["payload_bytes_per_token"]]
                                 for a in bench["ablation_patch"]]))
    if bench.get("ablation_rank"):
        sec.tables.append(Table("Key rank vs value rank (REUSE at every layer, codec truncated)",
                                ["rank K", "rank V", "score", "B/token"],
                                [[a["rank_k"], a["rank_v"], a["score"], a["payload_bytes_per_token"]]
                                 for a in bench["ablation_rank"]]))
    d = bench.get("drift") or {}
    if d.get("raw_drift_k"):
        sec.tables.append(Table("Per layer, held-out calibration prefixes (relative error; KL = consumer next-token "
                                "KL when only this layer is replaced)",
                                ["layer", "raw drift K", "raw drift V", "REUSE err K", "REUSE err V", "PATCH err K",
                                 "PATCH err V", "KL raw", "KL REUSE", "KL PATCH"],
                                [[i, *(d[k][i] for k in ("raw_drift_k", "raw_drift_v", "reuse_err_k", "reuse_err_v",
                                                         "patch_err_k", "patch_err_v", "impact_raw", "impact_reuse",
                                                         "impact_patch"))] for i in range(len(d["raw_drift_k"]))]))
    sec.figures.append(pareto_figure(bench, out_dir))
    sec.headline = targets(bench, art)
    sec.notes = notes(bench)
    sec.summary = {"results": bench["results"], "headline": [h.__dict__ for h in sec.headline],
                   "artifact": {"path": art.path, "status": art.status, "reason": art.reason,
                                "provenance": art.provenance}}
    return sec
