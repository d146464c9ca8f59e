"""Report section: state transfer across models — Semantic Cache Distillation against its baselines.

*Semantic Cache Distillation: Efficient State Transfer via Reuse and Selective Patching*
(``docs/techniques.md#across-models``). Reads the committed benchmark
``models/codec-ref-attn-ft/bench.json``, produced by::

    kvstate transfer bench --producer models/ref-attn --consumer models/ref-attn-ft \\
        --codec models/codec-ref-attn-ft --out models/codec-ref-attn-ft/bench.json

(measuring takes minutes, so the report reuses it): the method table, the TTFT-vs-quality Pareto plot,
the PATCH-budget ablation, the per-layer drift, and one headline row per target with met / missed.
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


def targets(bench: dict[str, Any], art: Artifact) -> list[HeadlineRow]:
    """The targets of SCD with this benchmark's values (rows marked stale when the file is)."""
    by = {r["method"]: r for r in bench["results"]}
    o, s = by["oracle"], by["scd"]
    rel = s["score"] / o["score"] if o["score"] > 0 else float("nan")
    # the bandwidth where SCD's transfer time equals its consumer compute: TTFT there = 2 x compute
    bpt, tokens = s["payload_bytes_per_token"], bench["mean_prompt_tokens"]
    balance_gbit = bpt * tokens * 8 / (s["consumer_ms"] * 1e-3) / 1e9 if s["consumer_ms"] > 0 else float("nan")
    speedup = o["consumer_ms"] / (2 * s["consumer_ms"]) if s["consumer_ms"] > 0 else float("nan")
    shrink = bench["fp16_raw_kv_bytes_per_token"] / bpt if bpt > 0 else float("nan")
    if s.get("items") and o.get("items") and len(s["items"]) == len(o["items"]):
        # SCD >= 0.95 x oracle on the same items: the paired interval of mean(scd - 0.95 oracle) against 0
        d = stats.paired_difference(s["items"], [0.95 * x for x in o["items"]])
        quality = artifact_row(art, TECHNIQUE, "SCD score >= 95% of the oracle's (paired interval of SCD - 0.95 x oracle)",
                               f"{s['score']:.3f} vs {o['score']:.3f} ({rel:.1%}); difference {d.value:+.3f} "
                               f"(n = {d.n})", status=stats.decide(d.lo, d.hi, 0.0), ci=(d.lo, d.hi), rate=True)
    else:
        quality = artifact_row(art, TECHNIQUE, "SCD score within 5% of the oracle (consumer's own prefill)",
                               f"{s['score']:.3f} vs {o['score']:.3f} ({rel:.1%})", bool(rel >= 0.95))
    return [
        quality,
        artifact_row(art, TECHNIQUE, ">= 2x TTFT vs the oracle where transfer and compute balance",
                    f"{speedup:.2f}x at {balance_gbit:.3g} Gbit/s ({o['consumer_ms']:.1f} ms vs "
                    f"2 x {s['consumer_ms']:.1f} ms)", bool(speedup >= 2)),
        artifact_row(art, TECHNIQUE, "payload >= 8x smaller than fp16 raw KV",
                    f"{shrink:.2f}x ({bpt:.0f} vs {bench['fp16_raw_kv_bytes_per_token']} B/token)", bool(shrink >= 8)),
    ]


def notes(bench: dict[str, Any]) -> list[str]:
    """Facts that cannot be missed: the baselines' measured quality."""
    by = {r["method"]: r for r in bench["results"]}
    o, raw, q4 = by["oracle"], by["raw"], by["kv4bit"]
    return [f"raw reuse {raw['score']:.3f} / ppl {raw['ppl']:.2f}, 4-bit KV {q4['score']:.3f} / ppl {q4['ppl']:.2f}, "
            f"oracle {o['score']:.3f} / ppl {o['ppl']:.2f} (from the committed bench)"]


def pareto_figure(bench: dict[str, Any], out_dir: Path) -> Figure:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    marks = dict(zip(("oracle", "raw", "kv4bit", "droidspeak", "reuse", "scd"), "o^vDsP", strict=True))
    for ax, metric, label in ((axes[0], "score", "score (needle tasks)"), (axes[1], "ppl", "perplexity (lower is better)")):
        for r in bench["results"]:
            xs = [r["ttft_ms"][b] for b in ("1", "10", "100")]
            ax.plot(xs, [r[metric]] * 3, ls=":", lw=0.8, marker=marks.get(r["method"], "o"), label=r["method"])
        ax.set_xscale("log")
        ax.set_xlabel("TTFT ms (points: 1, 10, 100 Gbit/s; right = slower link)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_dir / "transfer_pareto.png", dpi=100)
    plt.close(fig)
    return Figure("TTFT vs quality per method", "transfer_pareto.png",
                  "TTFT = payload bytes / bandwidth + consumer compute (measured here); the oracle transfers nothing.")


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
                 f"{bench['patch_layers']}; DroidSpeak block {bench['droidspeak_block']}. n = {cfg['n']} per needle task "
                 f"and length {cfg['lengths']}, seed {cfg['seed']}; perplexity on {cfg['ppl_n']} held-out texts of "
                 f"{cfg['ppl_length']} tokens. From `{path}` (`{COMMAND}`).")
    sec.tables.append(Table("Methods on the same prompts", [
        "method", "score", "F1", "ppl", "payload B/token", "consumer ms", "TTFT@1G ms", "TTFT@10G ms", "TTFT@100G ms",
        "loopback TCP ms"], [[r["method"], r["score"], r["f1"], r["ppl"], r["payload_bytes_per_token"], r["consumer_ms"],
                               r["ttft_ms"]["1"], r["ttft_ms"]["10"], r["ttft_ms"]["100"], r.get("loopback_ms", "")]
                              for r in bench["results"]]))
    cells = list(bench["results"][0]["per_task"])
    sec.tables.append(Table("Score per task and length", ["method", *cells],
                            [[r["method"], *(r["per_task"].get(c, "") for c in cells)] for r in bench["results"]]))
    weak = list(bench["results"][0].get("weak_tasks", {}))
    if weak:
        sec.tables.append(Table("Weak tasks (the full cache scores poorly here; shown, not targeted)", ["method", *weak],
                                [[r["method"], *(r["weak_tasks"].get(c, "") for c in weak)] for r in bench["results"]]))
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
