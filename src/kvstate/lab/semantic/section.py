"""Report section: resolution — SEKV against every other method at equal bytes, with intervals.

Reads the committed results of ``kvstate semantic eval`` (``models/ref-attn-sekv/eval.json``: the headline
grid of budgets 4:1 / 8:1 / 16:1, lengths and needle tasks; ``eval_sweep.json``: held-out perplexity;
``models/ref-hybrid-sekv/eval.json``: the hybrid reference model's attention layer, with the window-only
control) and renders accuracy against *attended* bytes and against *total* bytes (two plots, 95%
intervals), the real model's table first (:mod:`kvstate.lab.semantic.real_section`), the byte counts per method (resident, total, peak attended, full), the slow tier against its
budget, the methods that could not run and why, and one headline row per target. Accuracies are pooled
over the questions of the tasks the full cache solves at that length (:func:`kvstate.lab.protocol.solved_cells`),
with Wilson intervals; SEKV is compared with the best of *all* other methods by a paired bootstrap over
the same questions (:mod:`kvstate.lab.stats`). Nothing is re-measured here; the file names its command.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from kvstate.lab import stats
from kvstate.lab.protocol import solved_cells
from kvstate.lab.provenance import load_artifact, read_runs
from kvstate.lab.report.html import Figure, Section, Table, artifact_row, check_row
from kvstate.lab.semantic import methods, real_section

PAPER = "SEKV: Resolution-Adaptive Semantic KV Cache with Hierarchical Semantic Memory"
TECH = "resolution (SEKV)"
HEAD_BUDGET, HEAD_LENGTH, FULL_BUDGET = 0.125, 2048, 0.25
FULL = methods.reference()  # the full cache
SEKV = methods.names_with_role("proposed")[0]
CONTROL = "window"  # the hybrid's window-only control (a registered baseline)
BYTES = ("resident_bytes", "total_bytes", "attended_bytes_peak", "full_bytes")

EVAL_COMMAND = ("kvstate semantic eval --model models/ref-attn --router models/ref-attn-sekv --budget 0.25,0.125 "
                "--slow quant --bits 4 --task niah_single,niah_multikey,niah_4q --length 2048 --n 100 --seed 1042 "
                "--methods full,sekv,sekv_summaries,sekv_learned,sentencekv,quest,streaming,kivi,ExpectedAttentionPress,"
                "SnapKVPress --recent 16 --max-span 32 --expand-share 0.6 --json --out models/ref-attn-sekv/eval.json")
SWEEP_COMMAND = ("kvstate semantic eval --model models/ref-attn --router models/ref-attn-sekv --budget 0.125 --slow quant "
                 "--bits 4 --task ppl --length 1024 --n 200 --seed 1043 --methods full,sekv,quest,streaming --recent 16 "
                 "--max-span 32 --expand-share 0.5 --json --out models/ref-attn-sekv/eval_sweep.json")
HYBRID_COMMAND = ("kvstate semantic eval --model models/ref-hybrid --router models/ref-hybrid-sekv --budget 0.25,0.125 "
                  "--slow quant --bits 4 --task niah_single,niah_multikey,niah_4q --length 1024,2048 --n 100 "
                  "--seed 1044 --methods full,sekv,quest,streaming,window --recent 16 --max-span 32 --expand-share 0.5 "
                  "--json --out models/ref-hybrid-sekv/eval.json")


def _new_rows(run: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Rows carrying the byte counts (runs before byte counts were measured are not read)."""
    return [r for r in (run or {}).get("results", []) if all(k in r for k in BYTES) and r["task"] != "ppl"]


def _solved(run: dict[str, Any]) -> dict[int, set[str]]:
    """Per length: the tasks the full cache solves (>= SOLVED_AT) in this run."""
    full: dict[tuple[str, int], list[float]] = {}
    for c in run.get("cells", []):
        if c["method"] == FULL and c["task"] != "ppl":
            full.setdefault((c["task"], c["length"]), []).append(c["score"])
    out: dict[int, set[str]] = {}
    for task, length in solved_cells(full):
        out.setdefault(length, set()).add(task)
    return out


def _pooled(run: dict[str, Any], solved: dict[int, set[str]], length: int) -> dict[str, Any]:
    """A row's ``tasks`` (pooled: the ones the full cache solves at ``length``) and ``excluded_tasks`` (the rest)."""
    asked = {c["task"] for c in run.get("cells", []) if c["length"] == length and c["task"] != "ppl"}
    kept = solved.get(length, set())
    return {"tasks": tuple(sorted(kept)), "excluded_tasks": tuple(sorted(asked - kept))}


def _scores(run: dict[str, Any], method: str, budget: float | None, length: int,
            solved: dict[int, set[str]]) -> dict[tuple[str, int, int], float]:
    """Per question (task, item, question) of the solved tasks at ``length``: the score of ``method``."""
    return {(c["task"], c["index"], c["question"]): c["score"] for c in run.get("cells", [])
            if c["method"] == method and c["length"] == length and c["task"] in solved.get(length, set())
            and (budget is None or abs(c["budget"] - budget) < 1e-9)}


def _cells_of(rows: list[dict[str, Any]], method: str, budget: float, length: int) -> list[dict[str, Any]]:
    return [r for r in rows if r["method"] == method and r["length"] == length
            and (method == FULL or abs(r["budget"] - budget) < 1e-9)]


def _ratio(rows: list[dict[str, Any]], key: str) -> float:
    return float(np.mean([r[key] / r["full_bytes"] for r in rows])) if rows else float("nan")


def _points(run: dict[str, Any], rows: list[dict[str, Any]], length: int,
            solved: dict[int, set[str]]) -> dict[str, list[tuple[float, float, float, stats.Estimate]]]:
    """Per method: (budget, attended / full, total / full, pooled accuracy) at ``length``."""
    out: dict[str, list[tuple[float, float, float, stats.Estimate]]] = {}
    for m in dict.fromkeys(r["method"] for r in rows):
        for b in sorted({r["budget"] for r in rows if r["method"] == m}, reverse=True):
            s = _scores(run, m, None if m == FULL else b, length, solved)
            rs = [r for r in _cells_of(rows, m, b, length) if r["task"] in solved.get(length, set())]
            if s and rs:
                out.setdefault(m, []).append((b, _ratio(rs, "attended_bytes_peak"), _ratio(rs, "total_bytes"),
                                              stats.rate(list(s.values()))))
    return out


def _plots(points: dict[str, list[tuple[float, float, float, stats.Estimate]]], length: int,
           out_dir: Path) -> list[Figure]:
    figs = []
    for i, (name, label) in enumerate((("attended", "peak attended bytes / full KV"),
                                       ("total", "total bytes (every tier) / full KV"))):
        fig, ax = plt.subplots(figsize=(5.2, 3.4))
        for m, pts in points.items():
            x = [p[1 + i] for p in pts]
            y = [p[3].value for p in pts]
            err = np.array([[p[3].value - p[3].lo for p in pts], [p[3].hi - p[3].value for p in pts]])
            ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=m, linewidth=2 if m == SEKV else 1)
        ax.set_xscale("log", base=2)
        ax.set_xlabel(label)
        ax.set_ylabel("accuracy (solved tasks)")
        ax.set_ylim(-0.02, 1.02)
        ax.legend(fontsize=6, ncol=2)
        fig.tight_layout()
        fn = f"semantic_acc_vs_{name}.png"
        fig.savefig(out_dir / fn, dpi=100)
        plt.close(fig)
        figs.append(Figure(f"Accuracy vs {label}, {length} tokens", fn,
                           "One point per method and budget; bars: 95% Wilson intervals over the questions of the "
                           "tasks the full cache solves at this length."))
    return figs


def _grid(run: dict[str, Any], rows: list[dict[str, Any]], solved: dict[int, set[str]]) -> Table:
    budgets = sorted({r["budget"] for r in rows if r["method"] != FULL}, reverse=True)
    lengths = sorted({r["length"] for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    lines = []
    for b in budgets:
        for m in methods:
            line: list[Any] = [f"{round(1 / b)}:1", m]
            for L in lengths:
                s = _scores(run, m, None if m == FULL else b, L, solved)
                if not s:
                    line.append("–")
                    continue
                e = stats.rate(list(s.values()))
                line.append(f"{e.value:.3f} [{e.lo:.2f}, {e.hi:.2f}]")
            rs = [r for L in lengths for r in _cells_of(rows, m, b, L)]
            line += [round(_ratio(rs, k), 3) for k in ("attended_bytes_peak", "total_bytes", "resident_bytes")]
            exp = [r["expanded_fraction"] for r in rs if r.get("expanded_fraction") is not None]
            line.append(round(float(np.mean(exp)), 3) if exp else "–")
            lines.append(line)
    return Table("Accuracy (solved tasks, pooled questions, 95% interval) and bytes / full KV, per compression",
                 ["compression", "method", *[f"{L} tokens" for L in lengths], "attended / full", "total / full",
                  "resident / full", "expanded fraction"], lines,
                 note="full: no compression (the same row under every budget). Bytes are means over all lengths.")


def _headline(art: Any, run: dict[str, Any], rows: list[dict[str, Any]], solved: dict[int, set[str]]) -> list[Any]:
    head = []
    length = HEAD_LENGTH if any(r["length"] == HEAD_LENGTH for r in rows) else max(r["length"] for r in rows)
    sekv = _scores(run, SEKV, HEAD_BUDGET, length, solved)
    others = {m for m in (r["method"] for r in rows) if methods.role(m) == "baseline"}
    best, best_v = None, -1.0
    for m in sorted(others):
        s = _scores(run, m, HEAD_BUDGET, length, solved)
        if s and s.keys() == sekv.keys() and (v := float(np.mean(list(s.values())))) > best_v:
            best, best_v = m, v
    target = f"8:1, {length} tokens: SEKV >= the best other method at equal attended bytes + 5 points"
    if sekv and best is not None:
        keys = sorted(sekv)
        other = _scores(run, best, HEAD_BUDGET, length, solved)
        d = stats.paired_difference([sekv[k] for k in keys], [other[k] for k in keys])
        status = stats.decide(d.lo, d.hi, 0.05)
        head.append(artifact_row(art, TECH, target, f"{100 * d.value:+.1f} points vs {best} (n = {d.n})",
                                 status=status, ci=(d.lo, d.hi)))
    else:
        head.append(artifact_row(art, TECH, target, "SEKV or no other method ran on the same questions", None))
    s4, full = _scores(run, SEKV, FULL_BUDGET, length, solved), _scores(run, FULL, None, length, solved)
    if s4 and full:
        e = stats.rate(list(s4.values()))
        f = float(np.mean(list(full.values())))
        head.append(artifact_row(art, TECH, f"4:1, {length} tokens: SEKV >= 95% of the full cache",
                                 f"{e.value:.3f} / {f:.3f} = {e.value / f:.2f}", status=stats.decide(e.lo, e.hi, 0.95 * f),
                                 ci=(e.lo, e.hi), rate=True))
    ratios = [c["read_ratio_peak"] / c["budget"] for c in run.get("cells", [])
              if c["method"] == SEKV and "read_ratio_peak" in c]
    if ratios:
        head.append(check_row(TECH, "SEKV reads <= budget x full KV at every forward pass, every item",
                              max(ratios) <= 1.0, "the store caps the spans it expands at the budget",
                              f"max {max(ratios):.3f} of the budget over {len(ratios)} questions", art))
    tot = [r for r in rows if r["method"] == SEKV and abs(r["budget"] - HEAD_BUDGET) < 1e-9]
    if tot:
        v = _ratio(tot, "total_bytes")
        head.append(check_row(TECH, "8:1: SEKV total bytes (fast + compressed slow) <= 0.5 x full", v <= 0.5,
                              "budget 0.125 + slow_budget 0.375 of the raw span K/V (the constants)", f"{v:.3f} x full",
                              art))
    slow = [e for e in run.get("slow_tier", []) if e["method"] == SEKV]
    if slow:
        worst = max(e["slow_bytes"] / max(e["budget_bytes"], 1) for e in slow)
        head.append(check_row(TECH, "SEKV slow tier <= its budget", worst <= 1.0,
                              "ranks are allocated under the slow budget", f"max {worst:.3f} of the budget", art))
    return head


BOUNDS_COMMAND = ("kvstate semantic eval --model models/ref-attn --router models/ref-attn-sekv --budget 0.125 "
                  "--memory 0.3 --slow quant --bits 4 --task niah_single,niah_multikey,niah_4q --length 2048 --n 100 "
                  "--seed 1045 --methods full,sekv,quest,streaming,kivi --recent 16 --max-span 32 --expand-share 0.6 "
                  "--json --out models/ref-attn-sekv/eval_bounds.json")
MEMORY_COMMAND = ("kvstate semantic eval --model models/ref-attn --router models/ref-attn-sekv --budget 0.0625 "
                  "--memory 0.0625 --task niah_single,niah_multikey --length 4096 --n 100 --seed 1046 "
                  "--methods full,sekv_fresh,streaming,kivi,ExpectedAttentionPress,SnapKVPress --recent 16 "
                  "--max-span 128 --json --out models/ref-attn-sekv/eval_16x.json")
FOUR_COMMAND = ("kvstate semantic eval --model models/ref-attn --router models/ref-attn-sekv --budget 0.25 --slow quant "
                "--bits 4 --task niah_single,niah_multikey,niah_4q --length 2048 --n 100 --seed 1047 "
                "--methods full,sekv,quest --recent 16 --max-span 32 --expand-share 0.6 --json "
                "--out models/ref-attn-sekv/eval_4x.json")
DECODE_COMMAND = ("python -m kvstate.lab.semantic.timing --model models/ref-attn --router models/ref-attn-sekv "
                  "--length 2048 --budget 0.125 --methods full,sekv,quest --n 8 --repeats 7 --seed 1019 --memory 0.3 "
                  "--slow quant --bits 4 --max-span 32 --expand-share 0.6 --out models/ref-attn-sekv/decode.json")
PPL_LIMIT, DECODE_LIMIT = 0.03, 1.5
MEMORY_CAP, EQUAL_READS_GAP, MEMORY_MARGIN = 0.30, 0.03, 0.10


def _paired(run: dict[str, Any], a: str, b: str | None, budget: float, length: int, solved: dict[int, set[str]],
            scale: float = 1.0) -> stats.Estimate | None:
    """Paired mean of ``a - scale * b`` over the questions both answered (``b`` None: ``a`` alone, a rate)."""
    sa = _scores(run, a, budget, length, solved)
    if b is None:
        return stats.rate(list(sa.values())) if sa else None
    sb = _scores(run, b, None if b == FULL else budget, length, solved)
    keys = sorted(set(sa) & set(sb))
    if not keys:
        return None
    return stats.paired_difference([sa[k] for k in keys], [scale * sb[k] for k in keys])


def _bounds_targets(models_dir: Path) -> list[Any]:
    """The bounds-routed store at memory <= 0.30 (2K): 8:1 accuracy, the gap to Quest-like, 4:1 vs full."""
    art = load_artifact(models_dir / "ref-attn-sekv" / "eval_bounds.json", BOUNDS_COMMAND)
    rows = _new_rows(art.run)
    target = f"8:1 reads, memory <= {MEMORY_CAP}, 2K: SEKV >= 0.90 (solved tasks, pooled)"
    if not rows:
        return [artifact_row(art, TECH, target, "not run yet")]
    run, solved = art.run, _solved(art.run)
    length = max(r["length"] for r in rows)
    out = []

    def first(budget: float) -> str:
        """SEKV, or the first of its ablations that ran at ``budget`` (a sticky working set may not fit the cap)."""
        cands = [SEKV, *methods.names_with_role("ablation")]
        return next((m for m in cands if _scores(run, m, budget, length, solved)), SEKV)

    m8, m4 = first(HEAD_BUDGET), first(FULL_BUDGET)
    e = _paired(run, m8, None, HEAD_BUDGET, length, solved)
    if e is not None:
        out.append(artifact_row(art, TECH, target, f"{m8} {e.value:.3f} (n = {e.n})",
                                status=stats.decide(e.lo, e.hi, 0.90), ci=(e.lo, e.hi), rate=True,
                                **_pooled(run, solved, length)))
    d = _paired(run, m8, "quest", HEAD_BUDGET, length, solved)
    if d is not None:
        out.append(artifact_row(art, TECH, f"8:1, {length}: SEKV within {100 * EQUAL_READS_GAP:.0f} points of "
                                "Quest-like (paired)", f"{m8} {100 * d.value:+.1f} points (n = {d.n})",
                                status=stats.decide(d.lo, d.hi, -EQUAL_READS_GAP), ci=(d.lo, d.hi),
                                **_pooled(run, solved, length)))
    d = _paired(run, m4, FULL, FULL_BUDGET, length, solved, scale=0.95)
    if d is not None:
        out.append(artifact_row(art, TECH, f"4:1, {length}: SEKV >= 95% of the full cache (paired, memory <= "
                                f"{MEMORY_CAP})", f"{m4} - 0.95 x full = {100 * d.value:+.1f} points (n = {d.n})",
                                status=stats.decide(d.lo, d.hi, 0.0), ci=(d.lo, d.hi), **_pooled(run, solved, length)))
    held = [c for c in rows if c["method"] in (m8, m4)]
    if held:
        worst = max(r["total_bytes"] / r["full_bytes"] for r in held)
        out.append(check_row(TECH, f"SEKV total bytes <= {MEMORY_CAP} x full (every tier)", worst <= MEMORY_CAP + 1e-9,
                             "the memory cap sizes the slow tier", f"max {worst:.3f} x full", art))
    return out


def _four_target(models_dir: Path) -> list[Any]:
    """4:1 reads without a memory cap (2K): SEKV >= 95% of the full cache, paired."""
    art = load_artifact(models_dir / "ref-attn-sekv" / "eval_4x.json", FOUR_COMMAND)
    rows = _new_rows(art.run)
    target = "4:1 reads, 2K, no memory cap: SEKV >= 95% of the full cache (paired)"
    if not rows:
        return [artifact_row(art, TECH, target, "not run yet")]
    run, solved = art.run, _solved(art.run)
    length = max(r["length"] for r in rows)
    d = _paired(run, SEKV, FULL, FULL_BUDGET, length, solved, scale=0.95)
    if d is None:
        return [artifact_row(art, TECH, target, "no SEKV row on the solved tasks")]
    held = [r["total_bytes"] / r["full_bytes"] for r in rows if r["method"] == SEKV]
    return [artifact_row(art, TECH, target, f"SEKV - 0.95 x full = {100 * d.value:+.1f} points (n = {d.n}), "
                         f"total {max(held):.3f} x full", status=stats.decide(d.lo, d.hi, 0.0), ci=(d.lo, d.hi),
                                                          **_pooled(run, solved, length))]


def _memory_targets(models_dir: Path) -> list[Any]:
    """16:1 memory at 4K: SEKV against the best equal-memory baseline that ran (kvpress presses included when run)."""
    art = load_artifact(models_dir / "ref-attn-sekv" / "eval_16x.json", MEMORY_COMMAND)
    rows = _new_rows(art.run)
    target = "16:1 memory (<= 0.0625 x full), 4K: SEKV >= the best equal-memory baseline + 10 points"
    if not rows:
        return [artifact_row(art, TECH, target, "not run yet")]
    run, solved = art.run, _solved(art.run)
    length = max(r["length"] for r in rows)
    budget = min(r["budget"] for r in rows if r["method"] != FULL)
    proposed = [m for m in dict.fromkeys(r["method"] for r in rows) if methods.role(m) in ("proposed", "ablation")]
    if not proposed:
        return [artifact_row(art, TECH, target, "no SEKV row")]
    mine = proposed[0]
    # equal memory: a rival holds no more than the cap or than SEKV itself holds (both grow past the cap by the
    # question and answer tokens fed after compression, which every method keeps)
    held = max([budget] + [r["total_bytes"] / r["full_bytes"] for r in rows if r["method"] == mine])
    rivals = [m for m in dict.fromkeys(r["method"] for r in rows) if methods.role(m) == "baseline"
              and all(r["total_bytes"] <= held * r["full_bytes"] * 1.001 for r in rows if r["method"] == m)]
    if not rivals:
        return [artifact_row(art, TECH, target, "no equal-memory baseline row")]
    best = max(rivals, key=lambda m: float(np.mean(list(_scores(run, m, budget, length, solved).values()) or [0.0])))
    d = _paired(run, mine, best, budget, length, solved)
    if d is None:
        return [artifact_row(art, TECH, target, "no shared questions")]
    presses = [m for m in rivals if any(a.owns_result(m) for a in methods.ADAPTERS.values())]
    note = "" if presses else "; kvpress presses not run"
    return [artifact_row(art, TECH, target, f"{mine} vs {best}: {100 * d.value:+.1f} points (n = {d.n}){note}",
                         status=stats.decide(d.lo, d.hi, MEMORY_MARGIN), ci=(d.lo, d.hi),
                         **_pooled(run, solved, length))]


def _hybrid(models_dir: Path) -> tuple[list[Table], list[Any]]:
    art = load_artifact(models_dir / "ref-hybrid-sekv" / "eval.json", HYBRID_COMMAND)
    rows = _new_rows(art.run)
    if not rows:
        return [], [artifact_row(art, TECH, "hybrid: SEKV >= window-only + 5 points where window < full",
                                 "no rows with byte counts", None)]
    run = art.run
    solved = _solved(run)
    tables = [_grid(run, rows, solved)]
    tables[0].title = "ref-hybrid (its attention layer compressed): " + tables[0].title
    head = []
    for b in sorted({r["budget"] for r in rows if r["method"] == CONTROL}, reverse=True):
        for L in sorted({r["length"] for r in rows}):
            s, w = _scores(run, SEKV, b, L, solved), _scores(run, CONTROL, b, L, solved)
            full = _scores(run, FULL, None, L, solved)
            if not (s and w and full and s.keys() == w.keys()):
                continue
            if np.mean(list(w.values())) >= np.mean(list(full.values())):
                continue  # the control is not below the full cache: nothing to recover
            keys = sorted(s)
            d = stats.paired_difference([s[k] for k in keys], [w[k] for k in keys])
            head.append(artifact_row(art, TECH, f"hybrid {round(1 / b)}:1, {L} tokens: SEKV >= window only + 5 points",
                                     f"{100 * d.value:+.1f} points (n = {d.n})", status=stats.decide(d.lo, d.hi, 0.05),
                                     ci=(d.lo, d.hi)))
    return tables, head


def _ppl(models_dir: Path) -> list[Table]:
    art = load_artifact(models_dir / "ref-attn-sekv" / "eval_sweep.json", SWEEP_COMMAND)
    ppl = [r for r in (art.run or {}).get("results", []) if r["task"] == "ppl" and "score_ci" in r]
    if not ppl:
        return []
    lines = [[r["method"], r["budget"], r["length"], r["n"], round(r["score"], 3),
              f"[{r['score_ci'][0]:.3f}, {r['score_ci'][1]:.3f}]", round(r["attended_bytes_peak"] / r["full_bytes"], 3),
              round(r["total_bytes"] / r["full_bytes"], 3)] for r in ppl]
    stale = "" if art.status == "current" else f" [{art.status}: {art.reason}]"
    return [Table(f"Held-out perplexity, compress the context then continue{stale}",
                  ["method", "budget", "context tokens", "texts", "perplexity", "95% CI", "attended / full",
                   "total / full"], lines)]


def _ppl_target(models_dir: Path) -> list[Any]:
    """Held-out perplexity at 8:1 reads: SEKV within +3% of the full cache, a paired ratio over the same texts."""
    art = load_artifact(models_dir / "ref-attn-sekv" / "eval_sweep.json", SWEEP_COMMAND)
    cells = [c for c in (art.run or {}).get("cells", []) if c["task"] == "ppl"]
    target = f"held-out perplexity, 8:1 reads: SEKV <= +{100 * PPL_LIMIT:.0f}% of the full cache (paired)"

    def log_ppl(method: str) -> dict[int, float]:
        return {c["index"]: math.log(c["score"]) for c in cells
                if c["method"] == method and (method == FULL or abs(c["budget"] - HEAD_BUDGET) < 1e-9)}

    full, mine = log_ppl(FULL), log_ppl(SEKV)
    keys = sorted(set(full) & set(mine))
    if not keys:
        return [artifact_row(art, TECH, target, "no SEKV and full-cache texts in common")]
    ones = [1.0] * len(keys)  # every text scores the same number of continuation tokens: the mean log-ratio
    e = stats.paired_perplexity_ratio([mine[k] for k in keys], ones, [full[k] for k in keys], ones)
    beside = []
    for m in sorted({c["method"] for c in cells} - {FULL, SEKV}):  # every other method the run measured
        other = log_ppl(m)
        if set(keys) <= set(other):
            o = stats.paired_perplexity_ratio([other[k] for k in keys], ones, [full[k] for k in keys], ones)
            beside.append(f"{m} {100 * o.value:+.1f}%")
    length = max(c["length"] for c in cells)
    return [artifact_row(art, TECH, target, f"{SEKV} {100 * e.value:+.1f}% at {length} tokens (n = {e.n} texts"
                         + (f"; {', '.join(beside)}" if beside else "") + ")",
                         status=stats.decide(e.lo, e.hi, PPL_LIMIT, higher_is_better=False), ci=(e.lo, e.hi))]


ROUTE_COMMAND = ("python -m kvstate.lab.semantic.route_probe --length 2048 --budget 0.125 --n 40 --seed 2 --slow quant "
                 "--bits 4 --memory 0.3 --max-span 32 --expand-share 0.6 --out docs/results/sekv_route_probe.json "
                 "(and --seed 3)")
ROUTE_TOP, ROUTE_SHARE = 8, 0.95


def _route_target(models_dir: Path) -> list[Any]:
    """Routing on dev seeds: the needle's span in the top 8 under the shipped routing at every layer (the issue's
    measure), with the share where the layer's query points at the needle (its exact max logit ranks it so)."""
    path = models_dir.parent / "docs" / "results" / "sekv_route_probe.json"
    art = load_artifact(path, ROUTE_COMMAND)
    target = f"routing (dev seeds), 8:1, 2K: the needle's span in the top {ROUTE_TOP} at every layer in >= " \
             f"{100 * ROUTE_SHARE:.0f}% of items"
    newest = (art.run or {}).get("provenance", {}).get("commit")
    runs = [r for r in (read_runs(path) if art.run else [])  # the shipped configuration's probes of one commit
            if r.get("summaries") is False and r.get(f"top{ROUTE_TOP}_where_exact")
            and r.get("provenance", {}).get("commit") == newest]
    if not runs:
        return [artifact_row(art, TECH, target, "no probe of the shipped configuration")]
    hits = sum(round(r[f"top{ROUTE_TOP}_every_layer"] * r["in_span"]) for r in runs)
    n = sum(r["in_span"] for r in runs)
    e = stats.wilson(hits, n)
    cond = [r[f"top{ROUTE_TOP}_where_exact"] for r in runs]
    c = stats.wilson(sum(round(x["value"] * x["n"]) for x in cond), sum(x["n"] for x in cond))
    seeds = sorted({r["seed"] for r in runs})
    return [artifact_row(art, TECH, target, f"{e.value:.2f} of {n} items (seeds {seeds}); where the layer's exact "
                         f"max logit ranks the needle's span in the top {ROUTE_TOP}, the bound does too in "
                         f"{c.value:.3f} [{c.lo:.3f}, {c.hi:.3f}] of {c.n} (item, layer) pairs",
                         status=stats.decide(e.lo, e.hi, ROUTE_SHARE), ci=(e.lo, e.hi), rate=True,
                         seeds=tuple(seeds), n=n)]


def _decode_target(models_dir: Path) -> list[Any]:
    """Decode ms / token at 2K against the full cache: the median per-round ratio of interleaved repeats."""
    art = load_artifact(models_dir / "ref-attn-sekv" / "decode.json", DECODE_COMMAND)
    target = f"decode <= {DECODE_LIMIT}x the full cache's ms / token at 2K, question pass included"
    timing = (art.run or {}).get("timing", {})
    ratio = timing.get(SEKV, {}).get("ratio_to_reference")
    if not ratio:
        return [artifact_row(art, TECH, target, "not run yet")]
    rounds = [a / b for a, b in zip(timing[SEKV]["ms_per_token_rounds"], timing[FULL]["ms_per_token_rounds"],
                                    strict=True)]
    e = stats.timing(rounds, what="SEKV / full ms per token")
    beside = ", ".join(f"{m} {r['ratio_to_reference']['median']:.2f}x" for m, r in timing.items()
                       if m not in (SEKV, FULL) and "ratio_to_reference" in r)
    return [artifact_row(art, TECH, target, f"{e.value:.2f}x (median of {e.n} interleaved rounds; full "
                         f"{timing[FULL]['median']:.1f} ms / token" + (f"; {beside}" if beside else "") + ")",
                         status=stats.decide(e.lo, e.hi, DECODE_LIMIT, higher_is_better=False), ci=(e.lo, e.hi),
                         repeats=e.n, timing=True)]


def build(out_dir: Path, models_dir: Path) -> Section:
    title = "Resolution: SEKV, the resolution-adaptive semantic KV cache"
    real_tables, real_figures, real_head = real_section.build(models_dir, out_dir)  # the real model leads
    art = load_artifact(models_dir / "ref-attn-sekv" / "eval.json", EVAL_COMMAND)
    rows = _new_rows(art.run)
    if not rows:  # the headline file is missing or predates byte counts: the other files still show
        why = "No results" if art.run is None else "No results with byte counts (resident / total / attended)"
        hybrid_tables, hybrid_head = _hybrid(models_dir)
        return Section("semantic", title, paper=PAPER, intro=f"{why} in {art.path}; run `{EVAL_COMMAND}`.",
                       tables=real_tables + _ppl(models_dir) + hybrid_tables, figures=real_figures,
                       headline=[*real_head, artifact_row(art, TECH, "SEKV benchmark at equal bytes", ""),
                                 *hybrid_head])
    run = art.run
    solved = _solved(run)
    length = HEAD_LENGTH if any(r["length"] == HEAD_LENGTH for r in rows) else max(r["length"] for r in rows)
    points = _points(run, rows, length, solved)
    figures = real_figures + _plots(points, length, out_dir)
    tables = [*real_tables, _grid(run, rows, solved)]
    slow = run.get("slow_tier", [])
    if slow:
        lines = []
        for e in slow:
            ranks = {int(k): v for k, v in e["rank_histogram"].items()}
            caps = {int(k): v for k, v in e["cap_histogram"].items()}
            mean = lambda h: sum(k * v for k, v in h.items()) / max(sum(h.values()), 1)  # noqa: E731
            lines.append([e["method"], e["budget"], e["length"], round(e["slow_bytes"] / max(e["raw_span_bytes"], 1), 3),
                          round(e["slow_bytes"] / max(e["budget_bytes"], 1), 3), round(mean(ranks), 2),
                          round(mean(caps), 2), max(ranks, default=0)])
        tables.append(Table("Slow tier against its budget (ranks of every span's keys and values vs the byte cap)",
                            ["method", "budget", "length", "slow / raw span K/V", "slow / slow budget", "mean rank",
                             "mean cap n·D/(n+D)", "max rank"], lines))
    not_run = run.get("not_run", [])
    if not_run:
        tables.append(Table("Methods not run (never scored 0)", ["method", "budget", "why"],
                            [[e["method"], e["budget"], e["reason"]] for e in not_run]))
    tables += _ppl(models_dir)
    hybrid_tables, hybrid_head = _hybrid(models_dir)
    tables += hybrid_tables
    head = real_head + _headline(art, run, rows, solved) + _bounds_targets(models_dir) + _four_target(models_dir) \
        + _memory_targets(models_dir) + _ppl_target(models_dir) + _decode_target(models_dir) + _route_target(models_dir) + hybrid_head
    intro = (f"Model {run['model']}, router {run.get('router')}. Protocol: the context is prefilled and compressed "
             "without the question, then each question is fed to a copy of the compressed cache and answered greedily "
             "(niah_4q: four questions on one compressed cache). The budget caps, at every forward pass, the bytes a "
             "method keeps on the device and reads — kept K/V, summaries, metadata and every reconstructed span or "
             "fetched page (union over heads) — at budget x the full KV of the tokens seen; the slow tier is counted "
             "in total bytes. Accuracies pool the questions of the tasks the full cache solves (>= 0.9) at each "
             f"length: {', '.join(f'{L}: {sorted(t)}' for L, t in sorted(solved.items()))}. "
             "SEKV ranks spans by their key bounds and attends only the spans it expands, from a 4-bit slow tier; "
             "its ablations: sekv_summaries (the paper's summary entry for every unexpanded span), sekv_learned "
             "(the paper's learned routing), sekv_fresh (no working set), sekv_raw (raw slow tier). In-project "
             "baselines: quest (Quest-like pages), sentencekv (SentenceKV-like sentence retrieval), streaming "
             "(StreamingLLM-like sinks + window), kivi (whole-cache KIVI-style quantization); kvpress presses run "
             "in their own environment. "
             f"Produced by: {run.get('command', EVAL_COMMAND)}.")
    summary = {f"{m}@{p[0]}": {"attended": round(p[1], 4), "total": round(p[2], 4), "accuracy": round(p[3].value, 4),
                               "ci": [round(p[3].lo, 4), round(p[3].hi, 4)]}
               for m, pts in points.items() for p in pts}
    return Section("semantic", title, paper=PAPER, intro=intro, tables=tables, figures=figures,
                   summary={"length": length, "points": summary, "not_run": len(not_run)}, headline=head)
