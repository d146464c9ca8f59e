"""Report section: state transfer across models — Semantic Cache Distillation against its baselines.

*Semantic Cache Distillation: Efficient State Transfer via Reuse and Selective Patching*
(``docs/techniques.md#across-models``). For every producer → consumer pair of :data:`PAIRS` whose codec
exists it reads two committed result files next to the codec (measuring takes minutes to hours, so the
report reuses them; ``make reproduce`` regenerates both):

- ``bench.json`` from ``kvstate transfer bench``: quality per method and length with intervals, payload
  size, the PATCH budget rows, the rank ablation and the per-layer drift;
- ``ttft.json`` from ``benchmarks/transfer_ttft.py``: time to first token measured end to end over a
  loopback shaped by the kernel, cold / warm / oracle per method, length and link rate, with the rate
  the link actually achieved.

It shows the pairs side by side, the TTFT table, the TTFT-vs-quality Pareto front per link rate (quality
from ``bench.json`` with its interval), and one headline row per target and pair (met / missed /
undecided from paired intervals or, for times, from the spread of the repeats). A missing or stale file
marks its rows so and names the command that regenerates it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from kvstate.lab import stats
from kvstate.lab.provenance import Artifact, load_artifact
from kvstate.lab.report.html import Figure, HeadlineRow, Section, Table, artifact_row

PAPER = "Semantic Cache Distillation: Efficient State Transfer via Reuse and Selective Patching"
TECHNIQUE = "across models (SCD)"
BENCH_FILE, TTFT_FILE = "bench.json", "ttft.json"
TTFT_RATE, TTFT_LENGTH, TTFT_FACTOR = "1", 8192, 2.0  # the target: warm >= 2x faster than the oracle at 8K, 1 Gbit/s
FRONT_RIVALS = ("raw", "kivi4", "kivi2", "droidspeak")  # what SCD must not be dominated by on the Pareto front


@dataclass(frozen=True)
class Pair:
    """One producer → consumer pair and its codec, all directories under ``models/``."""

    label: str  # how the report names it ("shifted", "near-aligned")
    producer: str
    consumer: str
    codec: str
    pca_codec: str | None = None  # the producer-space PCA codec of the same pair: the reuse_pca_producer ablation

    def bench_command(self) -> str:
        # 25 items x 4 needle tasks = 100 per length; the key-vs-value rank ablation on 13 x 4 = 52 items per point
        pca = f"--pca-codec models/{self.pca_codec} " if self.pca_codec else ""
        return (f"kvstate transfer bench --producer models/{self.producer} --consumer models/{self.consumer} "
                f"--codec models/{self.codec} {pca}--n 25 --ppl-n 200 --ablation-n 13 --seed 1000 "
                f"--out models/{self.codec}/{BENCH_FILE}")

    def ttft_command(self) -> str:
        return (f"python benchmarks/transfer_ttft.py --producer models/{self.producer} --consumer models/{self.consumer} "
                f"--codec models/{self.codec} --rate 0.1,1,10 --length 1K,4K,8K --repeats 5 --seed 1000 "
                f"--out models/{self.codec}/{TTFT_FILE}")


# the default pair first: a consumer fine-tuned far enough that raw producer KV hurts it; then the committed,
# nearly aligned pair (raw reuse barely moves it). A pair whose codec directory is absent is listed, not read.
SHIFTED = Pair("shifted", "ref-attn", "ref-attn-ft2", "codec-ref-attn-ft2", "codec-ref-attn-ft2-pca")
NEAR_ALIGNED = Pair("near-aligned", "ref-attn", "ref-attn-ft", "codec-ref-attn-ft")
PAIRS = (SHIFTED, NEAR_ALIGNED)
CODEC, COMMAND = NEAR_ALIGNED.codec, NEAR_ALIGNED.bench_command()  # the pair that exists today


def pooled(bench: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per method, its rows over every length pooled: items in row order, bytes and scores averaged, and the
    pooled score's 95% interval (from the items where the rows carry them)."""
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
        if p["items"] and len(p["items"]) == sum(len(r.get("items") or []) for r in rows):
            e = stats.rate(p["items"])
            p["score"], p["ci"] = e.value, (e.lo, e.hi)
        else:  # rows without items: the rows' own intervals, widest bounds
            cis = [r["score_ci"] for r in rows if r.get("score_ci")]
            p["ci"] = (min(c[0] for c in cis), max(c[1] for c in cis)) if cis else (p["score"], p["score"])
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


def targets(bench: dict[str, Any], art: Artifact, label: str = "") -> list[HeadlineRow]:
    """The quality and size targets of SCD with this benchmark's values (rows marked stale when the file is)."""
    by = pooled(bench)
    o, s, raw = by["oracle"], by["scd"], by["raw"]
    bpt = s["payload_bytes_per_token"]
    shrink = bench["fp16_raw_kv_bytes_per_token"] / bpt if bpt > 0 else float("nan")
    tag = f"[{label}] " if label else ""
    return [
        _paired(art, f"{tag}premise: raw reuse <= 0.7 x the oracle (paired interval of raw - 0.7 x oracle)", raw, o,
                0.7, False),
        _paired(art, f"{tag}SCD score >= 95% of the oracle's (paired interval of SCD - 0.95 x oracle)", s, o, 0.95, True),
        artifact_row(art, TECHNIQUE, f"{tag}payload >= 8x smaller than fp16 raw KV",
                     f"{shrink:.2f}x ({bpt:.0f} vs {bench['fp16_raw_kv_bytes_per_token']} B/token)", bool(shrink >= 8)),
        *_between(art, tag, by), *_monotone(art, tag, by, bench.get("patch_budget") or []),
    ]


def _steps(by: dict[str, dict[str, Any]], chain: list[str]) -> list[Any] | None:
    """Paired differences (next - previous) along ``chain`` of methods, or None without per-item scores."""
    if any(m not in by or not by[m]["items"] or len(by[m]["items"]) != len(by[chain[0]]["items"]) for m in chain):
        return None
    return [stats.paired_difference(by[b]["items"], by[a]["items"]) for a, b in itertools.pairwise(chain)]


def _between(art: Artifact, tag: str, by: dict[str, dict[str, Any]]) -> list[HeadlineRow]:
    """REUSE alone between raw and SCD: ``raw <= reuse <= scd`` by the paired intervals of both steps."""
    d = _steps(by, ["raw", "reuse", "scd"])
    if d is None:
        return []
    status = ("missed" if any(stats.decide(x.lo, x.hi, 0.0) == "missed" for x in d)
              else "met" if all(stats.decide(x.lo, x.hi, 0.0) == "met" for x in d) else "undecided")
    shown = (f"raw {by['raw']['score']:.3f}, REUSE {by['reuse']['score']:.3f}, SCD {by['scd']['score']:.3f}; "
             f"REUSE - raw {d[0].value:+.3f} [{d[0].lo:+.3f}, {d[0].hi:+.3f}], SCD - REUSE {d[1].value:+.3f} "
             f"[{d[1].lo:+.3f}, {d[1].hi:+.3f}] (n = {d[0].n})")
    w = min(d, key=lambda x: x.hi)  # the step closer to failing carries the interval
    return [artifact_row(art, TECHNIQUE, f"{tag}REUSE alone between raw and SCD (paired intervals of both steps)",
                         shown, status=status, ci=(w.lo, w.hi), rate=True)]


def _monotone(art: Artifact, tag: str, by: dict[str, dict[str, Any]],
              budget: list[dict[str, Any]]) -> list[HeadlineRow]:
    """PATCH budget: quality non-decreasing in k within intervals — missed when a step's paired interval
    lies wholly below zero."""
    chain = [b["method"] for b in sorted(budget, key=lambda b: b["k"])]
    d = _steps(by, chain) if len(chain) > 1 else None
    if d is None:
        return []
    worst = min(range(len(d)), key=lambda i: d[i].hi)
    drops = [i for i, x in enumerate(d) if stats.decide(x.lo, x.hi, 0.0) == "missed"]
    shown = (", ".join(f"k={i} {by[m]['score']:.3f}" for i, m in enumerate(chain)) +
             f"; weakest step k={worst}->{worst + 1} {d[worst].value:+.3f} [{d[worst].lo:+.3f}, {d[worst].hi:+.3f}] "
             f"(n = {d[worst].n})")
    return [artifact_row(art, TECHNIQUE, f"{tag}PATCH quality non-decreasing in k within intervals", shown,
                         status="missed" if drops else "met", ci=(d[worst].lo, d[worst].hi), rate=True)]


def notes(bench: dict[str, Any], label: str = "") -> list[str]:
    """Facts that cannot be missed: the baselines' measured quality."""
    by = pooled(bench)
    o, raw = by["oracle"], by["raw"]
    q4 = by.get("kivi4") or by.get("kv4bit") or raw
    tag = f"{label}: " if label else ""
    return [f"{tag}raw reuse {raw['score']:.3f} / ppl {raw['ppl']:.2f}, 4-bit KV {q4['score']:.3f} / ppl "
            f"{q4['ppl']:.2f}, oracle {o['score']:.3f} / ppl {o['ppl']:.2f} (from the committed bench)"]


# --- time to first token ----------------------------------------------------------------------------


def ttft_cells(ttft: dict[str, Any]) -> dict[tuple[str, int, str], dict[str, Any]]:
    """``(method, length, rate key) -> {cold, warm, cold_range, warm_range, achieved, bytes_per_token}``."""
    out = {}
    for r in ttft.get("rows") or []:
        for key, t in (r.get("ttft_ms") or {}).items():
            rng = (r.get("ttft_range_ms") or {}).get(key) or {}
            out[(r["method"], int(r["length"]), key)] = {
                "cold": t["cold"], "warm": t["warm"], "cold_range": rng.get("cold") or [t["cold"]] * 2,
                "warm_range": rng.get("warm") or [t["warm"]] * 2, "n": r.get("n"),
                "achieved": (r.get("achieved_gbit_s") or {}).get(key),
                "bytes_per_token": r.get("payload_bytes_per_token", 0.0), "agrees": r.get("first_token_agrees")}
    return out


def _rate_label(key: str, links: dict[str, Any]) -> str:
    link = links.get(key) or {}
    achieved = link.get("achieved_gbit_s")
    shown = "loopback (unshaped)" if link.get("rate_gbit", key) is None else f"{key} Gbit/s"
    return f"{shown}, achieved {achieved:.3g}" if isinstance(achieved, (int, float)) else shown


def ttft_table(ttft: dict[str, Any], label: str) -> Table:
    """TTFT cold / warm per method x length x rate, with the rate the link achieved."""
    cells = ttft_cells(ttft)
    rows = [[m, length, key, "" if c["achieved"] is None else round(c["achieved"], 3),
             f"{c['cold']:.1f} [{c['cold_range'][0]:.1f}, {c['cold_range'][1]:.1f}]",
             "" if m == "oracle" else f"{c['warm']:.1f} [{c['warm_range'][0]:.1f}, {c['warm_range'][1]:.1f}]",
             round(c["bytes_per_token"] or 0.0, 1), "" if c["agrees"] is None else c["agrees"], c["n"]]
            for (m, length, key), c in cells.items()]
    return Table(f"[{label}] Time to first token, ms (median [min, max] of the repeats) per method, length and link",
                 ["method", "length", "set Gbit/s", "achieved Gbit/s", "cold", "warm", "B/token",
                  "first token = oracle's", "repeats"], rows,
                 note="cold = producer prefill + encode + wire + consumer decode + first token; warm = the payload "
                      "already in the store; oracle = the consumer's own prefill + first token (no link)")


def pareto_front(points: dict[str, tuple[float, float]]) -> list[str]:
    """Methods not dominated in (time: lower is better, score: higher is better); ties keep both."""
    front = []
    for m, (t, s) in points.items():
        if not any((t2 <= t and s2 >= s) and (t2 < t or s2 > s) for m2, (t2, s2) in points.items() if m2 != m):
            front.append(m)
    return sorted(front, key=lambda m: points[m][0])


def pareto_points(bench: dict[str, Any], ttft: dict[str, Any], key: str, length: int,
                  mode: str) -> dict[str, tuple[float, float]]:
    """``method -> (TTFT ms, pooled score)`` at one rate and length for the methods in both files."""
    by, cells = pooled(bench), ttft_cells(ttft)
    out = {}
    for (m, n, k), c in cells.items():
        if n == length and k == key and m in by:
            out[m] = (c["cold"] if m == "oracle" else c[mode], by[m]["score"])
    return out


def pareto_rows(bench: dict[str, Any], ttft: dict[str, Any]) -> tuple[int, list[dict[str, Any]]]:
    """(the length used, per rate and mode: the points and the front) at the longest measured length."""
    cells = ttft_cells(ttft)
    if not cells:
        return 0, []
    length = max(n for _, n, _ in cells)
    keys = list(dict.fromkeys(k for _, n, k in cells if n == length))
    out = []
    for key in keys:
        for mode in ("cold", "warm"):
            pts = pareto_points(bench, ttft, key, length, mode)
            if pts:
                out.append({"rate": key, "mode": mode, "points": pts, "front": pareto_front(pts)})
    return length, out


def pareto_ttft_figure(pairs: list[tuple[str, dict[str, Any], dict[str, Any]]], out_dir: Path) -> Figure | None:
    """TTFT vs quality per link rate (one panel per pair and rate; cold filled, warm open; score interval bars)."""
    panels = []
    for label, bench, ttft in pairs:
        length, rows = pareto_rows(bench, ttft)
        for key in dict.fromkeys(r["rate"] for r in rows):
            panels.append((label, key, length, bench, ttft))
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8), squeeze=False)
    for ax, (label, key, length, bench, ttft) in zip(axes[0], panels, strict=True):
        by = pooled(bench)
        color = {m: f"C{i % 10}" for i, m in enumerate(by)}
        for mode, filled in (("cold", True), ("warm", False)):
            for m, (t, s) in pareto_points(bench, ttft, key, length, mode).items():
                if m == "oracle" and not filled:
                    continue
                lo, hi = by[m]["ci"]
                ax.errorbar([t], [s], yerr=[[s - lo], [hi - s]], marker="o", ls="", capsize=2, color=color[m],
                            mfc=color[m] if filled else "none", label=m if filled else None)
        ax.set_xscale("log")  # decades only, labelled in plain ms (minor labels overlap on a short range)
        ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_title(f"{label}: {_rate_label(key, ttft.get('links') or {})}", fontsize=8)
        ax.set_xlabel(f"TTFT ms at {length} tokens (filled: cold, open: warm)", fontsize=8)
        ax.set_ylabel("score (needle tasks, 95% CI)", fontsize=8)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=6)
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_dir / "transfer_ttft_pareto.png", dpi=100)
    plt.close(fig)
    return Figure("Time to first token vs quality per link rate", "transfer_ttft_pareto.png",
                  "TTFT measured over a kernel-shaped loopback (medians of interleaved repeats); quality from the "
                  "pair's bench.json, pooled over its lengths, with 95% intervals.")


def ttft_targets(ttft: dict[str, Any], bench: dict[str, Any] | None, art: Artifact, label: str) -> list[HeadlineRow]:
    """Warm SCD vs the oracle at 8K on the 1 Gbit/s link (decided from the repeats' spread), and whether SCD is on
    the TTFT-vs-quality Pareto front against raw / KIVI / DroidSpeak at some rate."""
    tag = f"[{label}] " if label else ""
    what = f"{tag}warm TTFT >= {TTFT_FACTOR:g}x faster than the oracle at {TTFT_LENGTH // 1024}K on the " \
           f"{TTFT_RATE} Gbit/s link"
    cells = ttft_cells(ttft)
    scd, oracle = cells.get(("scd", TTFT_LENGTH, TTFT_RATE)), cells.get(("oracle", TTFT_LENGTH, TTFT_RATE))
    if scd is None or oracle is None:
        why = (ttft.get("skipped") or {}).get(TTFT_RATE)
        rows = [artifact_row(art, TECHNIQUE, what, "not measured: the file has no scd / oracle cell at "
                             f"{TTFT_LENGTH} tokens, {TTFT_RATE} Gbit/s" + (f" (rate skipped: {why})" if why else ""),
                             status="missing")]
    else:
        ratio = oracle["cold"] / scd["warm"]
        worst, best = oracle["cold_range"][0] / scd["warm_range"][1], oracle["cold_range"][1] / scd["warm_range"][0]
        status = "met" if worst >= TTFT_FACTOR else "missed" if best < TTFT_FACTOR else "undecided"
        achieved = f"; achieved {scd['achieved']:.3g} Gbit/s" if isinstance(scd["achieved"], (int, float)) else ""
        rows = [artifact_row(art, TECHNIQUE, what, f"{ratio:.2f}x (oracle {oracle['cold']:.0f} ms vs SCD warm "
                             f"{scd['warm']:.0f} ms; {worst:.2f}x-{best:.2f}x over the repeats' min / max{achieved})",
                             status=status)]
    front_what = f"{tag}SCD on the TTFT-vs-quality Pareto front against raw / KIVI / DroidSpeak at some rate"
    if bench is None:
        return [*rows, artifact_row(art, TECHNIQUE, front_what, f"no bench.json for the {label or 'default'} pair "
                                    "(quality)", status="missing")]
    length, pr = pareto_rows(bench, ttft)
    on = [f"{r['rate']} Gbit/s {r['mode']}" for r in pr
          if "scd" in pareto_front({m: p for m, p in r["points"].items() if m in ("scd", *FRONT_RIVALS)})]
    if not pr:
        rows.append(artifact_row(art, TECHNIQUE, front_what, "no TTFT rows shared with bench.json", status="missing"))
    else:
        rows.append(artifact_row(art, TECHNIQUE, front_what, (f"on the front at {', '.join(on)}" if on else
                                 "dominated at every rate") + f" ({length} tokens; point estimates)", bool(on)))
    return rows


# --- per pair ---------------------------------------------------------------------------------------------


def pareto_figure(pairs: list[tuple[str, dict[str, Any]]], out_dir: Path) -> Figure:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for label, bench in pairs:
        by = pooled(bench)
        for ax, metric in ((axes[0], "score"), (axes[1], "ppl")):
            for m, p in by.items():
                if p[metric] is None:
                    continue
                x = max(p["payload_bytes_per_token"], 1.0)  # the oracle ships nothing: drawn at 1 B
                ax.plot([x], [p[metric]], marker="o" if label == pairs[0][0] else "s", ls="", label=f"{label}: {m}")
    for ax, label in ((axes[0], "score (needle tasks)"), (axes[1], "perplexity (lower is better)")):
        ax.set_xscale("log")
        ax.set_xlabel("payload bytes per token (oracle drawn at 1)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=6)
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_dir / "transfer_pareto.png", dpi=100)
    plt.close(fig)
    return Figure("Payload size vs quality per method", "transfer_pareto.png",
                  "Payload bytes per token measured from the payloads sent; scores pooled over the lengths.")


def bench_tables(bench: dict[str, Any], label: str) -> list[Table]:
    """The bench's method, per-task, weak-task, PATCH-budget, rank-ablation and drift tables for one pair."""
    cfg, tag, out = bench["config"], f"[{label}] ", []
    out.append(Table(f"{tag}Methods on the same prompts (one row per method and length)", [
        "method", "length", "n", "score", "95% CI", "F1", "ppl", "payload B/token", "consumer ms"],
        [[r["method"], r.get("length", ""), r.get("n", ""), r["score"], str(r.get("score_ci", "")), r["f1"], r["ppl"],
          r["payload_bytes_per_token"], r["consumer_ms"]] for r in bench["results"]]))
    per_task: dict[str, dict[str, Any]] = {}
    for r in bench["results"]:
        per_task.setdefault(r["method"], {}).update(r["per_task"])
    cells = list(next(iter(per_task.values())))
    out.append(Table(f"{tag}Score per task and length", ["method", *cells],
                     [[m, *(v.get(c, "") for c in cells)] for m, v in per_task.items()]))
    weak = list(bench["results"][0].get("weak_tasks", {}))
    if weak:
        out.append(Table(f"{tag}Weak tasks (the full cache scores poorly here; shown, not targeted)", ["method", *weak],
                         [[r["method"], *(r["weak_tasks"].get(c, "") for c in weak)] for r in bench["results"]
                          if r.get("length", cfg["lengths"][0]) == cfg["lengths"][0]]))
    by = pooled(bench)
    if bench.get("patch_budget"):
        out.append(Table(f"{tag}PATCH budget k (the k layers with the largest calibrated patch gain; pooled over "
                         "lengths)", ["k", "layers", "score", "95% CI", "ppl", "B/token"],
                         [[b["k"], str(b["layers"]), round(by[b["method"]]["score"], 4),
                           "[{:.3f}, {:.3f}]".format(*by[b["method"]]["ci"]), by[b["method"]]["ppl"],
                           round(by[b["method"]]["payload_bytes_per_token"], 2)]
                          for b in bench["patch_budget"] if b["method"] in by]))
    if bench.get("ablation_rank"):
        out.append(Table(f"{tag}Key rank vs value rank (REUSE at every layer, codec truncated)",
                         ["rank K", "rank V", "score", "B/token"],
                         [[a["rank_k"], a["rank_v"], a["score"], a["payload_bytes_per_token"]]
                          for a in bench["ablation_rank"]]))
    d = bench.get("drift") or {}
    if d.get("raw_drift_k"):
        keys = ["raw_drift_k", "raw_drift_v", "reuse_err_k", "reuse_err_v", "patch_err_k", "patch_err_v",
                "impact_raw", "impact_reuse", "impact_patch"]
        cols = ["raw drift K", "raw drift V", "REUSE err K", "REUSE err V", "PATCH err K", "PATCH err V", "KL raw",
                "KL REUSE", "KL PATCH"]
        if d.get("patch_in_context"):  # codecs calibrated since the gain is measured in the codec's context
            keys, cols = [*keys, "patch_in_context", "patch_gain"], [*cols, "KL PATCH (REUSE elsewhere)", "gain"]
        out.append(Table(f"{tag}Per layer, held-out calibration prefixes (relative error; KL = consumer next-token "
                         "KL when only this layer is replaced, the rest exact unless said)", ["layer", *cols],
                         [[i, *(d[k][i] for k in keys)] for i in range(len(d["raw_drift_k"]))]))
    return out


def side_by_side(loaded: list[tuple[Pair, dict[str, Any]]]) -> Table:
    """The pairs next to each other: the premise (raw vs oracle) and SCD, pooled over lengths."""
    rows = []
    for pair, bench in loaded:
        by = pooled(bench)
        o, raw, s = by["oracle"], by["raw"], by["scd"]
        fmt = "{:.3f} [{:.3f}, {:.3f}]".format
        rows.append([pair.label, f"{pair.producer} → {pair.consumer}", fmt(o["score"], *o["ci"]),
                     fmt(raw["score"], *raw["ci"]), fmt(s["score"], *s["ci"]),
                     round(raw["score"] / o["score"], 3) if o["score"] else "",
                     round(s["score"] / o["score"], 3) if o["score"] else "",
                     round(bench["fp16_raw_kv_bytes_per_token"] / s["payload_bytes_per_token"], 2)
                     if s["payload_bytes_per_token"] else ""])
    return Table("Pairs side by side (scores pooled over lengths, 95% intervals)",
                 ["pair", "producer → consumer", "oracle", "raw reuse", "SCD", "raw / oracle", "SCD / oracle",
                  "payload shrink vs fp16 raw"], rows)


def build(out_dir: Path, models_dir: Path, pairs: tuple[Pair, ...] = PAIRS) -> Section:
    sec = Section("transfer", "Across models: Semantic Cache Distillation", paper=PAPER)
    loaded: list[tuple[Pair, dict[str, Any]]] = []
    timed: list[tuple[str, dict[str, Any], dict[str, Any]]] = []
    intro, headline, notes_out, tables, summary = [], [], [], [], {}
    for pair in pairs:
        root = models_dir / pair.codec
        if not root.is_dir():
            notes_out.append(f"{pair.label} pair ({pair.producer} → {pair.consumer}): no codec at models/{pair.codec} "
                             "yet (train the consumer, then `kvstate transfer calibrate`); not shown")
            continue
        art = load_artifact(root / BENCH_FILE, pair.bench_command())
        tart = load_artifact(root / TTFT_FILE, pair.ttft_command())
        bench = art.run
        summary[pair.label] = {"bench": {"path": art.path, "status": art.status, "reason": art.reason},
                               "ttft": {"path": tart.path, "status": tart.status, "reason": tart.reason}}
        if bench is None:
            intro.append(f"{pair.label}: no benchmark at {art.path}; produce it with `{art.command}`.")
            headline.append(artifact_row(art, TECHNIQUE, f"[{pair.label}] SCD targets", ""))
        else:
            cfg = bench["config"]
            intro.append(f"**{pair.label}**: producer `{bench.get('producer', pair.producer)}` prefills, consumer "
                         f"`{bench.get('consumer', pair.consumer)}` decodes. Codec ranks K/V/H_in {bench['ranks']}, "
                         f"{bench['bits']}-bit codes, PATCH layers {bench['patch_layers']} (REUSE map "
                         f"{bench.get('reuse_map')}); DroidSpeak block {bench['droidspeak_block']}. n = {cfg['n']} "
                         f"per needle task and length {cfg['lengths']}, seed {cfg['seed']}; perplexity on "
                         f"{cfg['ppl_n']} held-out texts of {cfg['ppl_length']} tokens. From `{art.path}` "
                         f"(`{art.command}`).")
            loaded.append((pair, bench))
            tables += bench_tables(bench, pair.label)
            headline += targets(bench, art, pair.label)
            notes_out += notes(bench, pair.label)
            summary[pair.label]["results"] = bench["results"]
        ttft = tart.run
        if ttft is None:
            intro.append(f"{pair.label}: no TTFT measurement at {tart.path}; produce it with `{tart.command}` "
                         "(root, for the shaped namespace).")
            headline.append(artifact_row(tart, TECHNIQUE, f"[{pair.label}] TTFT targets", ""))
            continue
        tables.append(ttft_table(ttft, pair.label))
        for key, why in (ttft.get("skipped") or {}).items():
            notes_out.append(f"{pair.label}: TTFT at {key} Gbit/s not measured — {why}")
        headline += ttft_targets(ttft, bench, tart, pair.label)
        summary[pair.label]["ttft_rows"] = ttft.get("rows")
        if bench is not None:
            timed.append((pair.label, bench, ttft))
            length, pr = pareto_rows(bench, ttft)
            tables.append(Table(f"[{pair.label}] TTFT-vs-quality Pareto front at {length} tokens",
                                ["link", "mode", "on the front (fastest first)", "dominated"],
                                [[_rate_label(r["rate"], ttft.get("links") or {}), r["mode"], ", ".join(r["front"]),
                                  ", ".join(sorted(set(r["points"]) - set(r["front"])))] for r in pr]))
    if len(loaded) > 1:
        tables.insert(0, side_by_side(loaded))
    if loaded:
        sec.figures.append(pareto_figure([(p.label, b) for p, b in loaded], out_dir))
    fig = pareto_ttft_figure(timed, out_dir)
    if fig is not None:
        sec.figures.append(fig)
    if not intro:
        intro.append("No pair's codec exists under models/; calibrate one with `kvstate transfer calibrate`, then "
                     f"measure it with `{COMMAND}`.")
        headline.append(artifact_row(load_artifact(models_dir / NEAR_ALIGNED.codec / BENCH_FILE, COMMAND),
                                     TECHNIQUE, "SCD targets", ""))
    sec.intro = " ".join(intro)
    sec.tables, sec.headline, sec.notes = tables, headline, notes_out
    sec.summary = {"pairs": summary, "headline": [h.__dict__ for h in headline]}
    return sec
