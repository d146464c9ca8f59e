"""Report section: state transfer across models — Semantic Cache Distillation against its baselines.

*Semantic Cache Distillation: Efficient State Transfer via Reuse and Selective Patching*
(``docs/techniques.md#across-models``). For every producer → consumer pair of :data:`PAIRS` whose codec
exists it reads two committed result files next to the codec (measuring takes minutes to hours, so the
report reuses them; ``make reproduce`` regenerates both):

- ``bench.json`` from ``kvstate transfer bench``: quality per method and length with intervals, payload
  size, the consumer layers each method recomputes, the PATCH budget rows, the rank ablation, the drift;
- ``ttft.json`` from ``kvstate transfer ttft``: time to first token measured end to end over a
  loopback shaped by the kernel, cold / warm / oracle per method, length and link rate, with the rate
  the link actually achieved.

Every target is decided under the measurement protocol (:mod:`kvstate.lab.protocol`): quality pools only
the (task, length) cells the oracle solves (mean >= 0.9) in that file, with the excluded cells and the
oracle's score there shown beside (files written before rows carried ``by_task`` are split back into
tasks from their per-item scores, which the bench appends task by task); each target is decided by
:func:`kvstate.lab.stats.decide` on a paired interval (straddling: undecided); times by the spread of
>= 5 interleaved repeats. The TTFT-vs-quality front is decided with intervals on both axes, the oracle
among the rivals, per link rate and per cold / warm, with quality taken at the TTFT length ("8K": the bench's
8,128-token prompts against TTFT's 8,192 — :data:`LENGTH_SLACK`); where the bench has no such length the
row says so and is undecided. A property that follows from the configuration (payload size from ranks and
bits) is a check, shown apart. A missing or stale file marks its rows so and names the command.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from kvstate.lab import protocol, stats
from kvstate.lab.provenance import Artifact, load_artifact
from kvstate.lab.report import floor
from kvstate.lab.report.html import Figure, HeadlineRow, Section, Table, artifact_row, check_row
from kvstate.lab.transfer import real_section
from kvstate.lab.transfer.ttft_table import (
    REFERENCE,
    TTFT_FACTOR,
    TTFT_LENGTH,
    TTFT_RATE,
    rate_label,
    ttft_cells,
    ttft_table,
)

PAPER = "Semantic Cache Distillation: Efficient State Transfer via Reuse and Selective Patching"
TECHNIQUE = "across models (SCD)"
BENCH_FILE, TTFT_FILE = "bench.json", "ttft.json"
LENGTH_SLACK = 64  # a bench length up to this many tokens below a TTFT length is that length (answer room)
SCD, RAW, REUSE = "scd", "raw", "reuse"  # rows the SCD targets read (a run without them is an options run)
RECOMPUTE, DROIDSPEAK = "scd_recompute", "droidspeak"  # the options run's rows


def has_method(run: dict[str, Any], name: str) -> bool:
    """Whether a bench run has rows of ``name`` (the SCD table reads the newest run with SCD; the options
    table the newest run with selective recompute)."""
    return name in {r.get("method") for r in run.get("results") or []}


def options_run(run: dict[str, Any]) -> bool:
    """A selective-recompute quality run (:meth:`Pair.options_command`)."""
    return has_method(run, RECOMPUTE)


def scd_run(run: dict[str, Any]) -> bool:
    """A run the SCD table and targets can read: SCD, raw and REUSE rows and held-out perplexity."""
    cfg = run.get("config") or {}
    return all(has_method(run, m) for m in (SCD, RAW, REUSE)) and int(cfg.get("ppl_n") or 0) > 0


def recompute_targets(bench: dict[str, Any], art: Artifact, label: str = "") -> tuple[list[HeadlineRow], Table]:
    """Selective recompute on the solved cells: >= 0.94 x the oracle and against DroidSpeak (paired), with the
    payload (<= 1/4 of fp16 raw KV) and the recomputed layers (<= 1) as checks — both follow from the design."""
    by = pooled(bench)
    o, rec = by[reference(bench)], by[RECOMPUTE]
    tag = f"[{label}] " if label else ""
    fp16 = float(bench["fp16_raw_kv_bytes_per_token"])
    bpt = float(rec["payload_bytes_per_token"])
    layers = list(rec.get("recomputed_layers") or [])
    rows = [_paired(art, bench, f"{tag}selective recompute >= 0.94 x the oracle (paired interval of recompute - "
                    "0.94 x oracle)", rec, o, 0.94, True)]
    if DROIDSPEAK in by:
        rows.append(_paired(art, bench, f"{tag}selective recompute's quality vs DroidSpeak's (paired interval of "
                            "recompute - DroidSpeak)", rec, by[DROIDSPEAK], 1.0, True))
    if RAW in by:  # where raw reuse already works (the near-aligned pair), recompute must not cost quality
        rows.append(_paired(art, bench, f"{tag}selective recompute no worse than raw reuse (paired interval of "
                            "recompute - raw)", rec, by[RAW], 1.0, True))
    rows += [check_row(TECHNIQUE, f"{tag}selective recompute ships <= 1/4 of fp16 raw KV bytes per token",
                       bool(bpt <= fp16 / 4), "the payload follows from the codes' ranks and bits",
                       f"{bpt:.0f} vs {fp16:.0f} B/token ({bpt / fp16:.1%})", art=art),
             check_row(TECHNIQUE, f"{tag}selective recompute recomputes <= 1 of the consumer's layers",
                       bool(len(layers) <= 1), "the codec recomputes the one layer its profile chose",
                       f"layers {layers}", art=art)]
    cfg = bench.get("config") or {}
    table = Table(f"[{label}] transfer options on test seed {cfg.get('seed')} (solved cells pooled over "
                  f"{cfg.get('lengths')}; `{art.command}`)" if label else "transfer options",
                  ["method", "score [95%]", "n", "B/token", "recomputed layers"],
                  [[m, f"{p['score']:.3f} {_ci(p['ci'])}", str(p["n"]), f"{p['payload_bytes_per_token']:.0f}",
                    str(p.get("recomputed_layers"))] for m, p in by.items()])
    return rows, table
BENCH_METHODS = "raw,raw_fp32,kivi4,kivi2,droidspeak,reuse,scd"  # the full SCD run every scd row reads
TTFT_METHODS = "raw,droidspeak,scd,scd_recompute"


@dataclass(frozen=True)
class Pair:
    """One producer → consumer pair and its codec, all directories under ``models/``."""

    label: str  # how the report names it ("shifted", "near-aligned")
    producer: str
    consumer: str
    codec: str
    pca_codec: str | None = None  # the producer-space PCA codec of the same pair: the reuse_pca_producer ablation
    bench_seed: int = 1001  # the test seed of the newest full SCD run (the ledger refuses a spent one)
    ttft_seed: int = 1001  # the test seed of the newest TTFT run
    options_seed: int = 1001  # the test seed of the newest selective-recompute quality run (the options run)
    options_cells: str = "--length 1024,2048 --n 50"  # its cells: 100 items per task on the solved ones

    def options_command(self) -> str:
        """The selective-recompute quality run (raw, DroidSpeak and recompute on the same items) the recompute
        targets read: a bench run of its own, appended to the same file."""
        return (f"kvstate transfer bench --producer models/{self.producer} --consumer models/{self.consumer} "
                f"--codec models/{self.codec} --methods raw,droidspeak,{RECOMPUTE} {self.options_cells} "
                f"--seed {self.options_seed} --ppl-n 0 --weak-n 0 --ablation-n 0 --no-budget "
                f"--out models/{self.codec}/{BENCH_FILE}")

    def bench_command(self) -> str:
        # 25 items x 4 needle tasks = 100 per length; the key-vs-value rank ablation on 13 x 4 = 52 items per point
        pca = f"--pca-codec models/{self.pca_codec} " if self.pca_codec else ""
        return (f"kvstate transfer bench --producer models/{self.producer} --consumer models/{self.consumer} "
                f"--codec models/{self.codec} {pca}--methods {BENCH_METHODS} --n 25 --length 1024,2048 --ppl-n 200 "
                f"--ablation-n 13 --seed {self.bench_seed} --out models/{self.codec}/{BENCH_FILE}")

    def ttft_command(self) -> str:
        return (f"kvstate transfer ttft --producer models/{self.producer} --consumer models/{self.consumer} "
                f"--codec models/{self.codec} --methods {TTFT_METHODS} --options scd_recompute.artifact=models/"
                f"{self.codec}/profiles/scd_recompute.safetensors --rate 0.1,1,10 --length 1K,4K,8K --repeats 5 "
                f"--seed {self.ttft_seed} --out models/{self.codec}/{TTFT_FILE}")


# the default pair first: a consumer fine-tuned far enough that raw producer KV hurts it; then the nearly
# aligned control (raw reuse barely moves it). A pair whose codec directory is absent is listed, not read.
SHIFTED = Pair("shifted", "ref-attn", "ref-attn-ft2", "codec-ref-attn-ft2", "codec-ref-attn-ft2-pca", bench_seed=1048,
               ttft_seed=1050, options_seed=1040)
# its oracle solves niah_single at 1K only: the options run puts its 100 items there
NEAR_ALIGNED = Pair("near-aligned", "ref-attn", "ref-attn-ft", "codec-ref-attn-ft", bench_seed=1049, ttft_seed=1051,
                    options_seed=1052, options_cells="--length 1024 --n 100")
PAIRS = (SHIFTED, NEAR_ALIGNED)
CODEC, COMMAND = SHIFTED.codec, SHIFTED.bench_command()  # the default pair


def reference(bench: dict[str, Any]) -> str:
    return str(bench.get("reference") or REFERENCE)


def cells(bench: dict[str, Any]) -> dict[str, dict[tuple[str, int], list[float]]]:
    """``method -> (task, length) -> per-item scores``: from each row's ``by_task``, or, for a file written
    before rows carried it, its ``items`` split back into ``config["n"]`` per task in ``config["tasks"]``
    order (the order the bench appends them). A row without per-item scores gives no cells."""
    cfg = bench.get("config") or {}
    tasks, n = list(cfg.get("tasks") or []), cfg.get("n")
    out: dict[str, dict[tuple[str, int], list[float]]] = {}
    for r in bench["results"]:
        got = out.setdefault(r["method"], {})
        length = int(r.get("length") or 0)
        if isinstance(r.get("by_task"), dict):
            for t, v in r["by_task"].items():
                got[(t, length)] = [float(x) for x in v.get("items") or []]
        elif r.get("items") and isinstance(n, int) and len(r["items"]) == n * len(tasks):
            for i, t in enumerate(tasks):
                got[(t, length)] = [float(x) for x in r["items"][i * n:(i + 1) * n]]
    return out


def pooled(bench: dict[str, Any], lengths: tuple[int, ...] | None = None) -> dict[str, dict[str, Any]]:
    """Per method, over its rows (at ``lengths``, default all): the per-item scores of the (task, length) cells the
    reference solves (:func:`kvstate.lab.protocol.solved_tasks`), their mean and 95% interval, the solved cells
    (``tasks``) and the excluded ones with the reference's mean (``excluded``); bytes, F1 averaged over rows.
    Without per-item scores: the rows' mean score and no interval (``ci`` None: nothing can be decided)."""
    by_cell = cells(bench)
    ref = {k: v for k, v in (by_cell.get(reference(bench)) or {}).items() if lengths is None or k[1] in lengths}
    split = protocol.solved_tasks(ref)
    out: dict[str, dict[str, Any]] = {}
    for r in bench["results"]:
        if lengths is None or int(r.get("length") or 0) in lengths:
            out.setdefault(r["method"], {"rows": []})["rows"].append(r)
    for m, p in out.items():
        rows = p["rows"]
        for key in ("f1", "payload_bytes_per_token"):
            p[key] = sum(float(r.get(key) or 0.0) for r in rows) / len(rows)
        p["ppl"] = rows[0].get("ppl")
        p["recomputed_layers"] = rows[0].get("recomputed_layers")
        p["tasks"] = [f"{t}@{length}" for t, length in split.solved]
        p["excluded"] = {f"{t}@{length}": round(v, 4) for (t, length), v in split.excluded.items()}
        mine = by_cell.get(m) or {}
        items = [x for k in split.solved for x in mine.get(k, [])] if all(k in mine for k in split.solved) else []
        p["items"] = items
        if items:
            e = stats.rate(items)
            p["score"], p["ci"], p["n"] = e.value, (e.lo, e.hi), e.n
        else:
            scores = [float(r["score"]) for r in rows if isinstance(r.get("score"), (int, float))]
            p["score"], p["ci"], p["n"] = (sum(scores) / len(scores) if scores else float("nan")), None, 0
    return out


def class_floor(bench: dict[str, Any], method: str, group: str) -> list[floor.ClassScore]:
    """``method`` per (task, length) class against the reference, on every class the reference scores
    >= :data:`kvstate.lab.report.floor.FLOOR_AT` on (solved or not): the classes pooling hides."""
    by_cell = cells(bench)
    ref = reference(bench)

    def named(d: dict[tuple[str, int], list[float]]) -> dict[str, list[float]]:
        return {f"{t}@{length}": v for (t, length), v in d.items()}

    return floor.class_scores(group, named(by_cell.get(method) or {}), named(by_cell.get(ref) or {}), ref)


def with_collapse(rows: list[HeadlineRow], what: str, scores: list[floor.ClassScore]) -> list[HeadlineRow]:
    """The pooled rows whose target names ``what``, with the classes the method fell below the floor on named in
    their measured text (a pooled score never hides a collapse)."""
    note = floor.collapse_note(scores)
    if not note:
        return rows
    out = []
    for r in rows:
        if what in r.target:
            head, sep, tail = r.measured.partition(" [stale: ")
            r = replace(r, measured=f"{head}{note}{sep}{tail}")
        out.append(r)
    return out


def _worst(arts: list[Artifact]) -> Artifact:
    """The file a row resting on several stands on: a stale or missing one if any."""
    return next((a for a in arts if a.status != "current"), arts[0])


def _about(p: dict[str, Any], bench: dict[str, Any]) -> dict[str, Any]:
    cfg = bench.get("config") or {}
    return {"n": p["n"], "tasks": tuple(p["tasks"]), "excluded_tasks": dict(p["excluded"]),
            **({"seeds": (int(cfg["seed"]),)} if isinstance(cfg.get("seed"), int) else {})}


def _paired(art: Artifact, bench: dict[str, Any], what: str, a: dict[str, Any], b: dict[str, Any], factor: float,
            higher: bool) -> HeadlineRow:
    """``a >= factor x b`` (or ``<=``) decided by the paired interval of ``a - factor x b`` on the same items of the
    solved cells; without per-item scores: undecided."""
    if a["items"] and len(a["items"]) == len(b["items"]):
        d = stats.paired_difference(a["items"], [factor * x for x in b["items"]])
        return artifact_row(art, TECHNIQUE, what, f"{a['score']:.3f} vs {b['score']:.3f}; difference {d.value:+.3f} "
                            f"[{d.lo:+.3f}, {d.hi:+.3f}] (n = {d.n}, solved cells only)",
                            status=stats.decide(d.lo, d.hi, 0.0, higher_is_better=higher), ci=(d.lo, d.hi), rate=True,
                            **_about(a, bench))
    return artifact_row(art, TECHNIQUE, what, f"{a['score']:.3f} vs {b['score']:.3f}; no per-item scores on solved "
                        "cells: not decided", status="undecided", **_about(a, bench))


def targets(bench: dict[str, Any], art: Artifact, label: str = "") -> list[HeadlineRow]:
    """The quality targets of SCD decided on the solved cells, and the payload-size check."""
    by = pooled(bench)
    o, s, raw = by[reference(bench)], by[SCD], by[RAW]
    bpt = s["payload_bytes_per_token"]
    shrink = bench["fp16_raw_kv_bytes_per_token"] / bpt if bpt > 0 else float("nan")
    tag = f"[{label}] " if label else ""
    return [
        _paired(art, bench, f"{tag}premise: raw reuse <= 0.7 x the oracle (paired interval of raw - 0.7 x oracle)",
                raw, o, 0.7, False),
        _paired(art, bench, f"{tag}SCD score >= 95% of the oracle's (paired interval of SCD - 0.95 x oracle)", s, o,
                0.95, True),
        check_row(TECHNIQUE, f"{tag}payload >= 8x smaller than fp16 raw KV", bool(shrink >= 8),
                  "the payload size follows from the codec's ranks, code bits and PATCH layers",
                  f"{shrink:.2f}x ({bpt:.0f} vs {bench['fp16_raw_kv_bytes_per_token']} B/token)", art=art),
        *_between(art, bench, tag, by), *_monotone(art, bench, tag, by, bench.get("patch_budget") or []),
    ]


def _steps(by: dict[str, dict[str, Any]], chain: list[str]) -> list[Any] | None:
    """Paired differences (next - previous) along ``chain`` of methods, or None without per-item scores."""
    if any(m not in by or not by[m]["items"] or len(by[m]["items"]) != len(by[chain[0]]["items"]) for m in chain):
        return None
    return [stats.paired_difference(by[b]["items"], by[a]["items"]) for a, b in itertools.pairwise(chain)]


def _between(art: Artifact, bench: dict[str, Any], tag: str, by: dict[str, dict[str, Any]]) -> list[HeadlineRow]:
    """REUSE alone between raw and SCD: ``raw <= reuse <= scd`` by the paired intervals of both steps."""
    d = _steps(by, ["raw", "reuse", "scd"])
    if d is None:
        return []
    status = protocol.combine_status([stats.decide(x.lo, x.hi, 0.0) for x in d])
    shown = (f"raw {by['raw']['score']:.3f}, REUSE {by['reuse']['score']:.3f}, SCD {by['scd']['score']:.3f}; "
             f"REUSE - raw {d[0].value:+.3f} [{d[0].lo:+.3f}, {d[0].hi:+.3f}], SCD - REUSE {d[1].value:+.3f} "
             f"[{d[1].lo:+.3f}, {d[1].hi:+.3f}] (n = {d[0].n}, solved cells only)")
    w = min(d, key=lambda x: x.hi)  # the step closer to failing carries the interval
    return [artifact_row(art, TECHNIQUE, f"{tag}REUSE alone between raw and SCD (paired intervals of both steps)",
                         shown, status=status, ci=(w.lo, w.hi), rate=True, **_about(by["scd"], bench))]


def _monotone(art: Artifact, bench: dict[str, Any], tag: str, by: dict[str, dict[str, Any]],
              budget: list[dict[str, Any]]) -> list[HeadlineRow]:
    """PATCH budget: quality non-decreasing in k — every step decided by its paired interval: missed when one lies
    wholly below zero, met only when every one lies at or above zero, undecided when any straddles."""
    chain = [b["method"] for b in sorted(budget, key=lambda b: b["k"])]
    d = _steps(by, chain) if len(chain) > 1 else None
    if d is None:
        return []
    worst = min(range(len(d)), key=lambda i: d[i].lo)
    status = protocol.combine_status([stats.decide(x.lo, x.hi, 0.0) for x in d])
    straddle = sum(stats.decide(x.lo, x.hi, 0.0) == "undecided" for x in d)
    shown = (", ".join(f"k={i} {by[m]['score']:.3f}" for i, m in enumerate(chain)) +
             f"; weakest step k={worst}->{worst + 1} {d[worst].value:+.3f} [{d[worst].lo:+.3f}, {d[worst].hi:+.3f}]; "
             f"{straddle} of {len(d)} steps straddle 0 (n = {d[worst].n}, solved cells only)")
    return [artifact_row(art, TECHNIQUE, f"{tag}PATCH quality non-decreasing in k (every step's paired interval)",
                         shown, status=status, ci=(d[worst].lo, d[worst].hi), rate=True, **_about(by["scd"], bench))]


def notes(bench: dict[str, Any], label: str = "") -> list[str]:
    """Facts that cannot be missed: the baselines' measured quality and what the solved-cell rule excluded."""
    by = pooled(bench)
    o, raw = by[reference(bench)], by["raw"]
    q4 = by.get("kivi4") or raw
    tag = f"{label}: " if label else ""
    out = [f"{tag}raw reuse {raw['score']:.3f} / ppl {raw['ppl']:.2f}, 4-bit KV {q4['score']:.3f} / ppl "
           f"{q4['ppl']:.2f}, oracle {o['score']:.3f} / ppl {o['ppl']:.2f} on the cells the oracle solves "
           f"({', '.join(o['tasks']) or 'none'}; from the committed bench)"]
    if o["excluded"]:
        out.append(f"{tag}excluded from every pooled score (oracle < {protocol.SOLVED_AT:g} there): " +
                   ", ".join(f"{k} {v:.2f}" for k, v in o["excluded"].items()))
    return out


# --- time to first token ----------------------------------------------------------------------------


def bench_length(bench: dict[str, Any], length: int) -> int | None:
    """The bench length that stands for a TTFT ``length``: equal, or up to :data:`LENGTH_SLACK` tokens below it (the
    bench leaves room for <bos> and the answer); None when the bench has none."""
    lengths = sorted({int(r.get("length") or 0) for r in bench["results"]}, reverse=True)
    return next((x for x in lengths if length - LENGTH_SLACK <= x <= length), None)


def _time_range(c: dict[str, Any], mode: str, ref: bool) -> tuple[float, float, float]:
    """(median, min, max) of a TTFT cell's repeats (the reference: its own prefill, the same cold and warm)."""
    m = "cold" if ref else mode
    lo, hi = c[f"{m}_range"]
    return float(c[m]), float(lo), float(hi)


def _compare(a: dict[str, Any], b: dict[str, Any]) -> tuple[int, int]:
    """(time, quality) of ``a`` against ``b``, each +1 decidedly better, -1 decidedly worse, 0 undecided: times by
    the repeats' ranges not overlapping, quality by the paired interval of ``a - b`` on the same items."""
    t = 1 if a["t_hi"] < b["t_lo"] else -1 if b["t_hi"] < a["t_lo"] else 0
    q = 0
    if a["items"] and len(a["items"]) == len(b["items"]):
        d = stats.paired_difference(a["items"], b["items"])
        q = {"met": 1, "missed": -1}.get(stats.decide(d.lo, d.hi, 0.0), 0)
    return t, q


def front_status(points: dict[str, dict[str, Any]], method: str) -> str:
    """Whether ``method`` is on the TTFT-vs-quality front against every other point (the oracle included): ``met``
    when against each rival it is decidedly better on some axis, ``missed`` when a rival is decidedly better on
    both, else ``undecided``."""
    me, verdicts = points[method], []
    for other, p in points.items():
        if other == method:
            continue
        t, q = _compare(me, p)
        verdicts.append("met" if t > 0 or q > 0 else "missed" if t < 0 and q < 0 else "undecided")
    return protocol.combine_status(verdicts) if verdicts else "met"


def pareto_points(bench: dict[str, Any], ttft: dict[str, Any], key: str, length: int,
                  mode: str) -> dict[str, dict[str, Any]]:
    """``method -> {t, t_lo, t_hi, score, ci, items}`` at one rate and TTFT length: time from the TTFT file, quality
    at the matching bench length (:func:`bench_length`) on the cells the oracle solves there; {} when the bench
    has no such length or the oracle solves no task there (quality cannot rank anything)."""
    at = bench_length(bench, length)
    if at is None:
        return {}
    by, ref = pooled(bench, (at,)), reference(bench)
    if ref not in by or not by[ref]["tasks"]:
        return {}
    out = {}
    for (m, n, k), c in ttft_cells(ttft).items():
        if n == length and k == key and m in by:
            t, lo, hi = _time_range(c, mode, m == ref)
            out[m] = {"t": t, "t_lo": lo, "t_hi": hi, "score": by[m]["score"], "ci": by[m]["ci"],
                      "items": by[m]["items"], "bench_length": at}
    return out


def pareto_rows(bench: dict[str, Any], ttft: dict[str, Any]) -> tuple[int, list[dict[str, Any]]]:
    """(the TTFT length used, per rate and mode: the points and each method's decided front status) at the
    longest TTFT length; no rows when the bench has no quality at that length."""
    cells_ = ttft_cells(ttft)
    if not cells_:
        return 0, []
    length = max(n for _, n, _ in cells_)
    keys = list(dict.fromkeys(k for _, n, k in cells_ if n == length))
    out = []
    for key in keys:
        for mode in ("cold", "warm"):
            pts = pareto_points(bench, ttft, key, length, mode)
            if pts:
                out.append({"rate": key, "mode": mode, "points": pts,
                            "status": {m: front_status(pts, m) for m in pts}})
    return length, out


def pareto_ttft_figure(pairs: list[tuple[str, dict[str, Any], dict[str, Any]]], out_dir: Path) -> Figure | None:
    """TTFT vs quality per link rate at equal length (one panel per pair and rate; cold filled, warm open; the
    repeats' range and the score's interval as bars); none where the bench has no quality at the TTFT length."""
    panels = []
    for label, bench, ttft in pairs:
        length, rows = pareto_rows(bench, ttft)
        for key in dict.fromkeys(r["rate"] for r in rows):
            panels.append((label, key, length, bench, ttft))
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8), squeeze=False)
    for ax, (label, key, length, bench, ttft) in zip(axes[0], panels, strict=True):
        ref = reference(bench)
        for mode, filled in (("cold", True), ("warm", False)):
            pts = pareto_points(bench, ttft, key, length, mode)
            color = {m: f"C{i % 10}" for i, m in enumerate(pts)}
            for m, p in pts.items():
                if m == ref and not filled:
                    continue
                lo, hi = p["ci"] or (p["score"], p["score"])
                ax.errorbar([p["t"]], [p["score"]], yerr=[[p["score"] - lo], [hi - p["score"]]],
                            xerr=[[p["t"] - p["t_lo"]], [p["t_hi"] - p["t"]]], marker="o", ls="", capsize=2,
                            color=color[m], mfc=color[m] if filled else "none", label=m if filled else None)
        ax.set_xscale("log")  # decades only, labelled in plain ms (minor labels overlap on a short range)
        ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_title(f"{label}: {rate_label(key, ttft.get('links') or {})}", fontsize=8)
        ax.set_xlabel(f"TTFT ms at {length} tokens (filled: cold, open: warm)", fontsize=8)
        ax.set_ylabel("score (solved cells, 95% CI)", fontsize=8)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=6)
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_dir / "transfer_ttft_pareto.png", dpi=100)
    plt.close(fig)
    return Figure("Time to first token vs quality per link rate, at equal length", "transfer_ttft_pareto.png",
                  "TTFT over a kernel-shaped loopback (medians and min / max of interleaved repeats); quality from the "
                  "pair's bench.json at the same length, on the cells the oracle solves, with 95% intervals.")


def ttft_targets(ttft: dict[str, Any], bench: dict[str, Any] | None, art: Artifact, label: str,
                 method: str = "scd", name: str = "SCD", rival: str | None = None,
                 named: bool = False) -> list[HeadlineRow]:
    """Warm ``method`` vs the oracle at 8K on the 1 Gbit/s link (decided from the repeats' spread), vs a ``rival``
    method's warm TTFT there when given (``rival`` / ``method`` > 1 over the repeats' min / max), and whether it is on
    the TTFT-vs-quality front at every rate, warm (intervals on both axes, the oracle among the rivals, equal
    length)."""
    tag = f"[{label}] " if label else ""
    who = f"{name} " if named else ""  # SCD's rows keep their names
    what = f"{tag}{who}warm TTFT >= {TTFT_FACTOR:g}x faster than the oracle at {TTFT_LENGTH // 1024}K on the " \
           f"{TTFT_RATE} Gbit/s link"
    cells_ = ttft_cells(ttft)
    scd, oracle = cells_.get((method, TTFT_LENGTH, TTFT_RATE)), cells_.get((REFERENCE, TTFT_LENGTH, TTFT_RATE))
    if scd is None or oracle is None:
        why = (ttft.get("skipped") or {}).get(TTFT_RATE)
        rows = [artifact_row(art, TECHNIQUE, what, f"not measured: the file has no {method} / oracle cell at "
                             f"{TTFT_LENGTH} tokens, {TTFT_RATE} Gbit/s" + (f" (rate skipped: {why})" if why else ""),
                             status="missing")]
    else:
        repeats = scd.get("n")
        try:
            o = stats.timing_row(oracle["cold"], oracle["cold_range"], oracle.get("n"), what="oracle TTFT")
            w = stats.timing_row(scd["warm"], scd["warm_range"], repeats, what=f"{name} warm TTFT")
        except Exception as exc:  # too few repeats or no spread: the row cannot be decided
            rows = [artifact_row(art, TECHNIQUE, what, f"not decided: {exc}", status="undecided")]
        else:
            ratio, worst, best = o.value / w.value, o.lo / w.hi, o.hi / w.lo
            achieved = f"; achieved {scd['achieved']:.3g} Gbit/s" if isinstance(scd["achieved"], (int, float)) else ""
            rows = [artifact_row(art, TECHNIQUE, what, f"{ratio:.2f}x (oracle {o.value:.0f} ms vs {name} warm "
                                 f"{w.value:.0f} ms; {worst:.2f}x-{best:.2f}x over the repeats' min / max{achieved})",
                                 status=stats.decide(worst, best, TTFT_FACTOR), repeats=repeats, ci=(worst, best))]
    riv = cells_.get((rival, TTFT_LENGTH, TTFT_RATE)) if rival else None
    if rival and scd is not None:
        vs_what = f"{tag}{name} warm TTFT faster than {rival} warm at {TTFT_LENGTH // 1024}K on the {TTFT_RATE} Gbit/s link"
        if riv is None:
            rows.append(artifact_row(art, TECHNIQUE, vs_what, f"not measured: no {rival} cell", status="missing"))
        else:
            try:
                r_ = stats.timing_row(riv["warm"], riv["warm_range"], riv.get("n"), what=f"{rival} warm TTFT")
                w_ = stats.timing_row(scd["warm"], scd["warm_range"], scd.get("n"), what=f"{name} warm TTFT")
            except Exception as exc:  # too few repeats or no spread
                rows.append(artifact_row(art, TECHNIQUE, vs_what, f"not decided: {exc}", status="undecided"))
            else:
                lo_, hi_ = r_.lo / w_.hi, r_.hi / w_.lo
                rows.append(artifact_row(art, TECHNIQUE, vs_what, f"{r_.value / w_.value:.2f}x ({rival} {r_.value:.0f} "
                                         f"ms vs {w_.value:.0f} ms; {lo_:.2f}x-{hi_:.2f}x over the repeats' min / max)",
                                         status=stats.decide(lo_, hi_, 1.0), repeats=scd.get("n"), ci=(lo_, hi_)))
    front_what = (f"{tag}{name} on the TTFT-vs-quality front at every rate, warm (intervals on both axes, the oracle "
                  "among the rivals, equal length)")
    if bench is None:
        return [*rows, artifact_row(art, TECHNIQUE, front_what, f"no bench.json for the {label or 'default'} pair "
                                    "(quality)", status="missing")]
    length = max((n for _, n, _ in cells_), default=TTFT_LENGTH)
    at = bench_length(bench, length)
    if at is None:
        measured = sorted({int(r.get("length") or 0) for r in bench["results"]})
        rows.append(artifact_row(art, TECHNIQUE, front_what, f"quality not measured at {length:,} tokens (the bench "
                                 f"has {', '.join(f'{x:,}' for x in measured)}): not decided", status="undecided"))
        return rows
    solved = pooled(bench, (at,)).get(reference(bench)) or {"tasks": [], "excluded": {}}
    if not solved["tasks"]:
        rows.append(artifact_row(art, TECHNIQUE, front_what, f"the oracle solves no task at {at:,} tokens ("
                                 + ", ".join(f"{k} {v:.2f}" for k, v in solved["excluded"].items())
                                 + "): quality cannot rank the methods there; not decided", status="undecided"))
        return rows
    _, pr = pareto_rows(bench, ttft)
    warm = [r for r in pr if r["mode"] == "warm" and method in r["status"]]
    if not warm:
        rows.append(artifact_row(art, TECHNIQUE, front_what, f"no warm {name} point shared with bench.json",
                                 status="missing"))
        return rows
    shown = "; ".join(f"{r['rate']} Gbit/s {r['mode']}: {r['status'][method]}" for r in pr if method in r["status"])
    rows.append(artifact_row(art, TECHNIQUE, front_what, f"{shown} ({length:,}-token TTFT, quality at {at:,})",
                             status=protocol.combine_status([r["status"][method] for r in warm])))
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
                         "the solved cells)", ["k", "layers", "score", "95% CI", "ppl", "B/token"],
                         [[b["k"], str(b["layers"]), round(by[b["method"]]["score"], 4), _ci(by[b["method"]]["ci"]),
                           by[b["method"]]["ppl"],
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


def _ci(ci: tuple[float, float] | None) -> str:
    return "" if ci is None else "[{:.3f}, {:.3f}]".format(*ci)


def side_by_side(loaded: list[tuple[Pair, dict[str, Any]]]) -> Table:
    """The pairs next to each other: the premise (raw vs oracle) and SCD, pooled over the solved cells."""
    rows = []
    for pair, bench in loaded:
        by = pooled(bench)
        o, raw, s = by[reference(bench)], by["raw"], by["scd"]

        def fmt(p: dict[str, Any]) -> str:
            return f"{p['score']:.3f} {_ci(p['ci'])}".strip()

        rows.append([pair.label, f"{pair.producer} → {pair.consumer}", ", ".join(o["tasks"]) or "none",
                     fmt(o), fmt(raw), fmt(s),
                     round(raw["score"] / o["score"], 3) if o["score"] else "",
                     round(s["score"] / o["score"], 3) if o["score"] else "",
                     round(bench["fp16_raw_kv_bytes_per_token"] / s["payload_bytes_per_token"], 2)
                     if s["payload_bytes_per_token"] else ""])
    return Table("Pairs side by side (scores pooled over the cells the oracle solves, 95% intervals)",
                 ["pair", "producer → consumer", "solved cells", "oracle", "raw reuse", "SCD", "raw / oracle",
                  "SCD / oracle", "payload shrink vs fp16 raw"], rows)


def _profiled(bench: dict[str, Any]) -> str:
    """The options each method's offline profiling chose (DroidSpeak's block), as the bench recorded them."""
    opts = bench.get("method_options")
    if not isinstance(opts, dict):  # a file from before methods were registered
        block = bench.get("droidspeak_block")
        opts = {"droidspeak": {"block": f"{block[0]}:{block[1]}"}} if isinstance(block, list) else {}
    return "profiled options " + (", ".join(f"{m} {k}={v}" for m, o in opts.items() for k, v in o.items()) or "none")


def build(out_dir: Path, models_dir: Path, pairs: tuple[Pair, ...] = PAIRS) -> Section:
    sec = Section("transfer", "Across models: Semantic Cache Distillation", paper=PAPER)
    loaded: list[tuple[Pair, dict[str, Any]]] = []
    timed: list[tuple[str, dict[str, Any], dict[str, Any]]] = []
    intro, headline, notes_out, tables, summary = [], [], [], [], {}
    floors: list[tuple[Artifact, dict[str, Any], str, list[floor.ClassScore]]] = []  # per pooled method: its classes
    floor_summary: list[dict[str, Any]] = []
    for pair in pairs:
        root = models_dir / pair.codec
        if not root.is_dir():
            notes_out.append(f"{pair.label} pair ({pair.producer} → {pair.consumer}): no codec at models/{pair.codec} "
                             "yet (train the consumer, then `kvstate transfer calibrate`); not shown")
            continue
        art = load_artifact(root / BENCH_FILE, pair.bench_command(), select=scd_run)
        options = load_artifact(root / BENCH_FILE, pair.options_command(), select=options_run)
        if options.run is not None:
            rows, table = recompute_targets(options.run, options, pair.label)
            fl = class_floor(options.run, RECOMPUTE, f"[{pair.label}] selective recompute")
            headline += with_collapse(rows, "selective recompute >= 0.94 x the oracle", fl)
            tables.append(table)
            floors.append((options, options.run, RECOMPUTE, fl))
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
                         f"{bench.get('reuse_map')}); {_profiled(bench)}. n = {cfg['n']} "
                         f"per needle task and length {cfg['lengths']}, seed {cfg['seed']}; perplexity on "
                         f"{cfg['ppl_n']} held-out texts of {cfg['ppl_length']} tokens. From `{art.path}` "
                         f"(`{art.command}`).")
            loaded.append((pair, bench))
            tables += bench_tables(bench, pair.label)
            fl = class_floor(bench, SCD, f"[{pair.label}] SCD")
            headline += with_collapse(targets(bench, art, pair.label), "SCD score >= 95% of the oracle's", fl)
            floors.append((art, bench, SCD, fl))
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
        if any(r.get("method") == RECOMPUTE for r in ttft.get("rows") or []):
            headline += ttft_targets(ttft, options.run or bench, tart, pair.label, RECOMPUTE, "selective recompute",
                                     rival=DROIDSPEAK, named=True)
        summary[pair.label]["ttft_rows"] = ttft.get("rows")
        if bench is not None:
            timed.append((pair.label, bench, ttft))
            length, pr = pareto_rows(bench, ttft)
            if pr:
                tables.append(Table(
                    f"[{pair.label}] TTFT-vs-quality front at {length} tokens, decided with intervals on both axes "
                    "(the oracle among the rivals)", ["link", "mode", "on the front", "dominated", "undecided"],
                    [[rate_label(r["rate"], ttft.get("links") or {}), r["mode"],
                      *(", ".join(sorted((m for m, v in r["status"].items() if v == want),
                                         key=lambda m: r["points"][m]["t"])) for want in ("met", "missed", "undecided"))]
                     for r in pr]))
            else:
                notes_out.append(f"{pair.label}: no TTFT-vs-quality front — the bench has no quality at the TTFT "
                                 f"length {length:,} (its lengths: {cfg['lengths']})")
    if floors:  # one class-floor row for the section, over every pooled method of every pair
        scores = [c for *_, fl in floors for c in fl]
        no_items = not any(cells(b).get(reference(b)) and cells(b).get(method) for _, b, method, _ in floors)
        headline.append(floor.floor_row(_worst([a for a, *_ in floors]), TECHNIQUE, scores, no_items=no_items))
        pooled_text = {}
        for _, bench_, method, fl in floors:
            if fl:
                p = pooled(bench_)[method]
                pooled_text[fl[0].group] = f"{p['score']:.3f} {_ci(p['ci'])}".strip()
        tables.append(floor.floor_table(scores, f"Per task class beside the pooled score: every class the oracle "
                                                f"scores >= {floor.FLOOR_AT:g} on, against {floor.FLOOR:g}x the "
                                                "oracle", pooled_text))
        floor_summary = [{"group": c.group, "class": c.cls, "score": None if c.score is None else
                                   c.score.value, "reference": c.ref_score, "ratio": c.ratio,
                                   "diff_ci": None if c.diff is None else [c.diff.lo, c.diff.hi], "status": c.status}
                                  for c in scores]
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
        headline.append(artifact_row(load_artifact(models_dir / CODEC / BENCH_FILE, COMMAND),
                                     TECHNIQUE, "SCD targets", ""))
    real_tables, real_figures, real_head = real_section.build(models_dir, out_dir)  # the real pair leads
    intro.insert(0, "**Real pair** (SmolLM2-135M-Instruct → its LoRA fine-tune answering in JSON, "
                 "`models/smollm2-135m-ft-delta/README.md`): whether the producer's raw cache serves the consumer, and "
                 "the drift of the two caches, first; the 4-layer reference pairs after it.")
    sec.intro = " ".join(intro)
    sec.tables, sec.headline, sec.notes = real_tables + tables, real_head + headline, notes_out
    sec.figures[:0] = real_figures
    sec.summary = {"pairs": summary, "headline": [h.__dict__ for h in headline], "class_floor": floor_summary}
    return sec
