"""Report section: sparse prefix caching — where to checkpoint recurrent state inside a cached prefix.

Implements the evaluation of "Sparse Prefix Caching for Hybrid and Recurrent LLM Serving" on seeded
synthetic workloads (``kvstate.lab.workloads.traces``): share of overlapping tokens saved per placement method and
checkpoint budget, checkpoints needed to match block caching, wall-clock of resume / restore / capture on a
small Qwen3.5-shaped model, and exactness of a resumed prefill against a full one.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvstate.lab import stats
from kvstate.lab.prefix.evaluate import match_block, match_block_per_entry, savings_table, workload_weights
from kvstate.lab.prefix.timing import bench_model, measure_engine
from kvstate.lab.report import plots
from kvstate.lab.report.html import Figure, HeadlineRow, Section, Table, check_row, pct, pivot, run_row
from kvstate.lab.workloads.traces import WORKLOADS
from kvstate.models import checkpoint_bytes, qwen35_08b_config, segmented_prefill, tiny_model
from kvstate.prefix.engine import SparsePrefixCache
from kvstate.prefix.placement import plan_checkpoints, planner_names

BUDGETS = [1, 2, 4, 8, 16, 32]
ALIGN = 64  # Qwen3.5's Gated DeltaNet chunk size
HIGHLIGHT = "optimal"  # the planner drawn bold in the savings plot
PAPER = "Sparse Prefix Caching for Hybrid and Recurrent LLM Serving"
TECHNIQUE = "position (sparse prefix caching)"
CAPTURE_MAX = 1.10  # capture overhead target: x a plain prefill
R2_MIN = 0.95  # wall-clock saved ~ tokens saved, linear fit
RESTORE_MAX = 0.10  # restore time / time saved
LOGIT_TOL = 1e-4  # fp32 resumed vs full prefill
EXACT_FAMILIES = ("qwen3_5", "bamba")  # a hybrid with Gated DeltaNet, a hybrid with Mamba2
N_REQUESTS = 400  # seeded requests per workload
# the seed of everything this section measures live (workload traces, the timing model's weights and prompt): a
# test seed (issue 42: no headline row on a dev seed); the planners and timing code were designed on seed 0
TRACE_SEED = LIVE_SEED = 1078
TIMING_TOKENS, TIMING_REPEATS = 1024, 5  # prompt length and interleaved rounds of the engine timing (>= 5)


def build(out_dir: Path, models_dir: Path) -> Section:
    ck = checkpoint_bytes(qwen35_08b_config())
    long_rows: list[list[Any]] = []
    records: list[dict[str, Any]] = []
    match_rows: list[list[Any]] = []
    summary: dict[str, Any] = {}
    fig, axes = plots.figure(1.0, 3.4, ncols=len(WORKLOADS), sharey=True)
    cells = wins = 0
    best_gain = (-1.0, "", 0)
    for ax, wl in zip(axes[0], WORKLOADS, strict=True):
        w = workload_weights(wl, n_requests=N_REQUESTS, seed=TRACE_SEED)
        table = savings_table(w, wl, BUDGETS, planner_names(), ALIGN)
        for method in planner_names():
            pts = [r for r in table if r.method == method]
            ax.plot([r.slots for r in pts], [100 * r.saved_fraction for r in pts], marker="o", ms=3,
                    color=plots.color(method), lw=2.2 if method == HIGHLIGHT else 1, label=method)
        for m in BUDGETS:
            by = {r.method: r.saved_fraction for r in table if r.slots == m}
            best_base = max(v for k, v in by.items() if k != HIGHLIGHT)
            cells, wins = cells + 1, wins + (by["optimal"] >= best_base - 1e-12)
            if by["optimal"] - best_base > best_gain[0]:
                best_gain = (by["optimal"] - best_base, wl, m)
        ax.set_xscale("log", base=2)
        ax.set_xticks(BUDGETS, [str(b) for b in BUDGETS])
        ax.set_title(wl.replace("_", " "))
        ax.set_xlabel("checkpoint slots M")
        long_rows += [[r.workload, r.method, r.slots, r.positions, r.saved_fraction] for r in table]
        records += [{"workload": wl, "M": r.slots, "method": r.method, "saved": r.saved_fraction} for r in table]
        n_block, n_opt, frac = match_block(w, 64, ALIGN)
        e_block, e_opt = match_block_per_entry(wl, N_REQUESTS, 0, 64, ALIGN)
        match_rows.append([wl, pct(frac), n_block, n_opt, e_block, e_opt, f"{e_block * ck / 2**30:.2f}",
                           f"{e_opt * ck / 2**30:.2f}"])
        summary[wl] = {
            "saved_fraction": {m: [r.saved_fraction for r in table if r.method == m] for m in planner_names()},
            "block64_checkpoints": n_block,
            "optimal_checkpoints_to_match": n_opt,
            "per_entry_block64_checkpoints": e_block,
            "per_entry_optimal_checkpoints": e_opt,
        }
    axes[0][0].set_ylabel("overlapping tokens not recomputed (%)")
    axes[0][-1].legend(fontsize=7, loc="lower right")
    savings_fig = plots.save(fig, out_dir, "prefix_savings.png")
    summary["budgets"] = BUDGETS
    summary["optimal_vs_baselines"] = {"cells": cells, "cells_optimal_not_below": wins,
                                       "largest_gain_pp": round(100 * best_gain[0], 1),
                                       "largest_gain_workload": best_gain[1], "largest_gain_slots": best_gain[2]}
    timing_table, timing_fig, t = _engine_timing(out_dir)
    summary["engine_timing"] = t
    planner_row, summary["planner"] = _planner_timing()
    summary["exactness"] = ex = resume_exactness()
    sp = summary.get("system_prompts", {})
    headline = [
        check_row(TECHNIQUE, "exact DP placement saves >= every baseline at every budget", wins == cells,
                  "the DP is the exact optimum over the grid (Theorem 2); a baseline is one point of that grid",
                  f"{wins} of {cells} workload × budget cells"),
        _capture_row(t),
        check_row(TECHNIQUE, f"resumed prefill = full prefill (fp32 max |Δ logit| <= {LOGIT_TOL:.0e}; bf16 "
                  "bit-identical at chunk-aligned checkpoints)",
                  ex["fp32_max_abs_logit_diff"] <= LOGIT_TOL and ex["bf16_bit_identical"] and ex["reused_tokens"] > 0,
                  "a resumed pass recomputes the same arithmetic from the restored state (an exactness check of "
                  "the code, not a result)",
                  f"{ex['fp32_max_abs_logit_diff']:.1e} fp32; bf16 "
                  + ("bit-identical" if ex["bf16_bit_identical"] else "differs")),
        _no_interval_row(f"wall-clock saved is linear in tokens restored (R² >= {R2_MIN:.2f})",
                         f"R² = {t['fit_r2']:.3f}"),
        _no_interval_row(f"restoring a checkpoint costs <= {RESTORE_MAX:.0%} of the time it saves",
                         f"at most {pct(t['restore_overhead_max'])}"),
    ]
    if sp:
        headline.append(check_row(
            TECHNIQUE, "system prompts: the exact DP matches block-64 caching's savings with no more checkpoints",
            sp["optimal_checkpoints_to_match"] <= sp["block64_checkpoints"],
            "block-64's positions lie on the DP's 64-token grid and the DP is the exact optimum there, so the fewest "
            "optimal checkpoints saving as much cannot exceed block's (tests/lab/prefix/test_prefix_evaluate.py); how "
            "many fewer is a property of this seeded trace",
            f"{sp['optimal_checkpoints_to_match']} vs {sp['block64_checkpoints']} checkpoints",
            seeds=(TRACE_SEED,), n=N_REQUESTS, tasks=("system_prompts",)))
    conclusion = (
        f"The exact DP saved at least as much recompute as every baseline in {wins} of {cells} workload × budget "
        f"cells; its largest lead over the best baseline is {100 * best_gain[0]:.1f} percentage points "
        f"({best_gain[1].replace('_', ' ')}, M = {best_gain[2]})"
        + (", at a small budget, where placement matters most." if best_gain[2] <= 4 else ".")
        + (f" On system prompts it matches block-64 caching with {sp['optimal_checkpoints_to_match']} checkpoints "
           f"instead of {sp['block64_checkpoints']}." if sp else "")
        + f" On a Qwen3.5-shaped model, time saved grows linearly with the tokens restored (R² = {t['fit_r2']:.3f}), "
        f"a restore costs at most {pct(t['restore_overhead_max'])} of the time it saves, capturing checkpoints "
        f"costs {t['capture_ratio']:.3f}× a plain prefill, and resumed logits equal a full prefill to "
        f"{ex['fp32_max_abs_logit_diff']:.1e} (fp32)."
    )
    compact = [pivot([r for r in records if r["workload"] == wl], "M", "method", "saved",
                     f"{wl.replace('_', ' ')}: tokens saved (%)", fmt=pct) for wl in WORKLOADS]
    return Section(
        key="prefix",
        title="Position: sparse prefix caching for hybrid and recurrent models",
        paper=PAPER,
        conclusion=conclusion,
        intro=f"Overlap-depth histograms pooled over {N_REQUESTS} seeded requests per workload; checkpoints on a "
        f"{ALIGN}-token grid (Qwen3.5's chunk). Saved = share of overlapping tokens restored instead of "
        f"recomputed. Bytes use one Qwen3.5-0.8B checkpoint = {ck:,} B. Timing: medians of interleaved rounds, "
        "1 thread (benchmarks/prefix_engine.py runs the 2,048-token version).",
        figures=[Figure("Work saved vs checkpoint budget, per workload", savings_fig,
                        "Share of overlapping tokens restored from a checkpoint rather than recomputed; the exact DP "
                        "(thick blue) against the paper's baselines and Marconi-style junction placement."),
                 timing_fig],
        tables=[*compact,
                Table("Checkpoints needed to match block-64 caching",
                      ["workload", "block-64 saves", "block ckpts", "optimal ckpts", "block ckpts per entry",
                       "optimal ckpts per entry", "block GiB per entry", "optimal GiB per entry"], match_rows,
                      "Pooled: one entry of the longest prefix; per entry: each prefix with its own histogram, "
                      "summed. GiB at Qwen3.5-0.8B's checkpoint size."),
                timing_table],
        details=[Table("Work saved per workload, method and budget", ["workload", "method", "M", "placed", "saved"],
                       long_rows),
                 Table("Planner speed (exact DP, bimodal weights)", ["N", "M", "align", "seconds"], [planner_row])],
        headline=headline,
        summary=summary,
    )


def _no_interval_row(target: str, value: str) -> HeadlineRow:
    """A live timing target without an interval: ``measure_engine`` keeps the per-depth medians of its rounds,
    not each round's times, so no spread of R² or of the restore share can be computed — undecided, never met."""
    return run_row(TECHNIQUE, target, f"{value}; not decided: no interval — the live timing "
                   "(kvstate.lab.prefix.timing.measure_engine) keeps only each depth's median over its interleaved "
                   "rounds; an interval needs each round's times", status="undecided", n=TIMING_REPEATS, seeds=(LIVE_SEED,))


def _capture_row(t: dict[str, Any]) -> HeadlineRow:
    """Capture overhead decided on the spread of its per-round ratios (median of >= 5 interleaved rounds)."""
    target = f"capturing checkpoints during prefill costs <= {CAPTURE_MAX:.2f}× a plain prefill"
    est = stats.timing(t["capture_ratios"], what="capture / plain prefill")
    status = stats.decide(est.lo, est.hi, CAPTURE_MAX, higher_is_better=False)
    return run_row(TECHNIQUE, target, f"{est.value:.3f}×", status=status, ci=(est.lo, est.hi), timing=True,
                   repeats=est.n, n=est.n, seeds=(LIVE_SEED,))


def _engine_timing(out_dir: Path) -> tuple[Table, Figure, dict[str, Any]]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # less sensitive to other load; ratios are what we report
    try:
        t = measure_engine(bench_model(LIVE_SEED), n=TIMING_TOKENS, align=64, slots=8, repeats=TIMING_REPEATS,
                           seed=LIVE_SEED)
    finally:
        torch.set_num_threads(threads)
    saved = [t.resume_s[0] - r for r in t.resume_s]
    rows = [[c, f"{tr * 1e3:.1f}", f"{tre * 1e3:.2f}", f"{s * 1e3:.1f}"]
            for c, tr, tre, s in zip(t.depths, t.resume_s, t.restore_s, saved, strict=True)]
    fig, axes = plots.figure(0.6, 3.4)
    ax = axes[0][0]
    ax.plot(t.depths, [1e3 * s for s in saved], "o", color=plots.color("optimal"), label="measured")
    k, b = np.polyfit(t.depths, saved, 1)
    ax.plot(t.depths, [1e3 * (k * c + b) for c in t.depths], "--", color="grey", label=f"linear fit, R² = {t.fit_r2:.3f}")
    ax.set_xlabel("tokens restored from a checkpoint (c)")
    ax.set_ylabel("time saved vs full prefill (ms)")
    ax.legend()
    name = plots.save(fig, out_dir, "prefix_resume_time.png")
    table = Table(f"Resume vs full prefill ({t.n_tokens} tokens, 8-layer Qwen3.5-shaped model, CPU, 1 thread)",
                  ["restore at c", "resume ms", "restore ms", "saved ms"], rows,
                  f"Capture during prefill: {t.capture_ratio:.2f}× a plain prefill.")
    figure = Figure("Wall-clock saved vs tokens restored", name,
                    f"Medians of {TIMING_REPEATS} interleaved rounds; c = 0 is a full prefill.")
    return table, figure, t.as_json()


def _planner_timing() -> tuple[list[object], dict[str, object]]:
    n, m = 131072, 64
    w = np.zeros(n + 1)
    w[0], w[n // 3], w[n] = 0.5, 0.3, 0.2
    w[1:] += 1e-4  # a little mass everywhere: the dense, hard case for the hull
    t0 = time.perf_counter()
    plan_checkpoints(w, m, "optimal", 1)
    seconds = time.perf_counter() - t0
    return [n, m, 1, f"{seconds:.3f}"], {"n": n, "slots": m, "seconds": seconds}


@torch.no_grad()
def resume_exactness() -> dict[str, Any]:
    """A second request resumed from the first's checkpoints vs a full prefill of it, on tiny models.

    fp32: max |Δ logit| over ``EXACT_FAMILIES`` (elementwise CPU kernels differ by ~1e-6 between split and
    one-shot calls). bf16 (Qwen3.5, eager attention): bit-identical to the same segmented computation.
    """
    g = torch.Generator().manual_seed(7)

    def ids(n: int) -> torch.Tensor:
        return torch.randint(0, 128, (1, n), generator=g)

    worst, reused = 0.0, []
    for family in EXACT_FAMILIES:
        model = tiny_model(family)
        cache = SparsePrefixCache(model, budget_bytes=64 << 20, slots_per_entry=4, align=8)
        doc = ids(96)
        cache.prefill(torch.cat([doc, ids(8)], 1))
        request = torch.cat([doc, ids(12)], 1)
        res = cache.prefill(request)
        reused.append(res.reused_tokens)
        worst = max(worst, float((res.logits - segmented_prefill(model, request).logits).abs().max()))
    model = tiny_model("qwen3_5", dtype=torch.bfloat16)
    model.set_attn_implementation("eager")  # SDPA's kernel choice depends on the query length
    cache = SparsePrefixCache(model, budget_bytes=64 << 20, slots_per_entry=2)
    doc = ids(cache.align * 2 + 10)
    cache.prefill(doc)
    request = torch.cat([doc[:, : cache.align * 2 + 5], ids(7)], 1)
    res = cache.prefill(request)
    same = segmented_prefill(model, request, cuts=[res.reused_tokens, request.shape[1] - 1]).logits
    return {"families": list(EXACT_FAMILIES), "fp32_max_abs_logit_diff": worst, "reused_tokens": min(reused),
            "bf16_reused_tokens": res.reused_tokens,
            "bf16_bit_identical": bool(res.reused_tokens > 0 and torch.equal(res.logits, same))}
