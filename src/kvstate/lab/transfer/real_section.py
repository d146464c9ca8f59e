"""Report part: the real cross-model pair (SmolLM2-135M-Instruct → its LoRA fine-tune) — does the producer's raw
K/V serve the consumer, and how far the consumer's cache drifted (Semantic Cache Distillation's premise,
``docs/techniques.md#across-models``; the pair: :mod:`kvstate.lab.transfer.realpair`).

Reads the committed ``models/smollm2/pair_premise.json`` (:mod:`kvstate.lab.transfer.realpair_eval`, newest run):
per task the oracle (the consumer's own prefill), raw reuse and the producer with intervals; the premise's
decision as a headline row; the per-layer K / V cosine between the two caches as a table and a figure. Then the
methods on the pair, ``models/smollm2/pair_bench.json`` (:mod:`kvstate.lab.transfer.realpair_bench`): per method
and task the score, its paired difference to the oracle, bytes against a bf16 cache, layers recomputed, the gate's
reading and the gated score; every pre-registered decision (and the gate's, decided by the bench) a headline row;
score against recomputed share as a figure. Held-out perplexity and greedy agreement under transfer,
``models/smollm2/pair_ppl.json`` (:mod:`kvstate.lab.transfer.realpair_ppl`): per method the perplexity, its paired
ratio to the oracle's and the +3% target's decision (a headline row each). A missing or stale file shows the
command that writes it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvstate.lab.experiment import headline_fields
from kvstate.lab.provenance import load_artifact
from kvstate.lab.report import plots
from kvstate.lab.report.html import Figure, HeadlineRow, Table, artifact_row

FILE = "smollm2/pair_premise.json"
BENCH_FILES = {"niah_single": "smollm2/pair_bench.json", "niah_multikey": "smollm2/pair_bench_multikey.json"}
BENCH_FILE = BENCH_FILES["niah_single"]


def bench_command(task: str) -> str:
    return ("OMP_NUM_THREADS=1 python -m kvstate.lab.transfer.realpair_bench --n 100 --seed SEED "
            f"--task {task} --out models/{BENCH_FILES[task]}")
COMMAND = ("OMP_NUM_THREADS=1 python -m kvstate.lab.transfer.realpair_eval --n 100 --seed SEED "
           "--out models/smollm2/pair_premise.json")
WHERE = "real pair (SmolLM2 → LoRA fine-tune)"


def _figure(drift: dict[str, Any], out_dir: Path) -> Figure:
    fig, axes = plots.figure(0.6, 3.0)
    ax = axes[0][0]
    layers = list(range(len(drift["drift_k"])))
    ax.plot(layers, drift["drift_k"], "o-", ms=3, label="K (after RoPE)")
    ax.plot(layers, drift["drift_v"], "s-", ms=3, label="V")
    ax.set_xlabel("layer")
    ax.set_ylabel("cosine, producer vs consumer cache")
    ax.legend(fontsize=7)
    name = plots.save(fig, out_dir, "smollm2_pair_drift.png")
    return Figure("The real pair's drift: per layer, the mean cosine of the two models' cached K and V", name,
                  f"mean over positions, KV heads and {drift['items']} items")


def _bench_figure(rows: list[dict[str, Any]], about: dict[str, Any], out_dir: Path, task: str) -> Figure:
    fig, axes = plots.figure(0.6, 3.0)
    ax = axes[0][0]
    for r in rows:
        a = about.get(r["method"], {"flops_share": 1.0})
        ax.errorbar([a["flops_share"]], [r["value"]], yerr=[[r["value"] - r["ci"][0]], [r["ci"][1] - r["value"]]],
                    fmt="o", ms=4, capsize=2)
        ax.annotate(r["method"], (a["flops_share"], r["value"]), fontsize=6, xytext=(3, 2), textcoords="offset points")
    ax.set_xlabel("share of the consumer's layers recomputed (oracle: 1)")
    ax.set_ylabel("score (RULER string_match_all)")
    name = plots.save(fig, out_dir, f"smollm2_pair_bench_{task}.png")
    return Figure(f"The real pair ({task}): each method's score against the share of layers the consumer recomputes",
                  name,
                  "95% intervals; the oracle is the consumer's own prefill")


def _differences(records: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    """Each method's paired difference to the oracle per task class, read from the run's items — every class, the
    ones the oracle does not solve too (a display interval; the decisions stay the loop's)."""
    from kvstate.lab.stats import paired_difference
    from kvstate.lab.transfer.realpair_bench import ORACLE

    cells: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for r in records:
        scores = r.get("scores") or {}
        for m, v in scores.items():
            if m != ORACLE and ORACLE in scores:
                cells.setdefault((m, str(r.get("task"))), []).append((float(v), float(scores[ORACLE])))
    out = {}
    for key, pairs in cells.items():
        est = paired_difference([a for a, _ in pairs], [b for _, b in pairs])
        out[key] = {"value": est.value, "ci": [est.lo, est.hi], "n": est.n}
    return out


def bench(models_dir: Path, out_dir: Path, task: str = "niah_single",
          ) -> tuple[list[Table], list[Figure], list[HeadlineRow]]:
    """The methods on the real pair for one task class (its own result file): the table, the figure, the headline
    rows."""
    art = load_artifact(models_dir / BENCH_FILES[task], bench_command(task))
    if art.run is None:
        return [], [], [artifact_row(art, WHERE, f"the best transfer >= 0.95x the oracle ({task})", "")]
    run = art.run
    exp = run.get("experiment") or {}
    seeds = ", ".join(str(s) for s in exp.get("seeds", []))
    app = run.get("appendix") or {}
    about, gate = app.get("methods") or {}, app.get("gate") or {}
    per_gate = gate.get("methods") or {}
    diffs = _differences(run.get("items") or [])
    rows = run.get("rows") or []
    body = []
    for r in rows:
        a, g = about.get(r["method"], {}), per_gate.get(r["method"], {})
        d = diffs.get((r["method"], r["task"]))
        body.append([r["method"], r["task"], f"{r['value']:.2f} [{r['ci'][0]:.2f}, {r['ci'][1]:.2f}] ({r['n']})",
                     f"{d['value']:+.2f} [{d['ci'][0]:+.2f}, {d['ci'][1]:+.2f}]" if d else "",
                     f"{a['bf16_share']:.2f}" if a else "", f"{a['recomputed']:.0f}" if a else "30 (all)",
                     f"{a['gate_error']:.3f}" if "gate_error" in a else "",
                     f"{g['gated']:.2f} ({g['accepted']}/{g['items']} served)" if g else "", seeds, art.status])
    table = Table(f"Real pair, {task} at {', '.join(str(x) for x in exp.get('lengths', []))} tokens: every "
                  "transfer method against the consumer's own prefill",
                  ["method", "task", "score [95%] (n)", "− oracle [95%]", "bytes / bf16 cache", "layers recomputed",
                   "gate reading", f"gated score (gate <= {gate.get('max_error', '')})", "seed", "file"], body,
                  "RULER string_match_all over greedy replies; bytes are the serialised payload over a bf16 K+V cache "
                  "of 30 layers; the gate reading is the mean relative K/V error of the last 32 context tokens "
                  "recomputed by the consumer on the transferred prefix (its own cache reads ~0); the gated score "
                  "serves the method where the gate accepts and the oracle's own prefill where it refuses")
    head = [artifact_row(art, WHERE, f"{d['label']} ({task})",
                         f"{d['value']:+.3f} [{d['ci'][0]:+.3f}, {d['ci'][1]:+.3f}]", **headline_fields(d))
            for d in run.get("decisions") or [] if d.get("value") is not None]
    if gate.get("decision"):
        fa = f"{gate['false_accept_rate']:.3f} [{gate['false_accept_ci'][0]:.3f}, {gate['false_accept_ci'][1]:.3f}]"
        head.append(artifact_row(art, WHERE, f"the gate: {gate['target']} (at max error {gate['max_error']}; {task})",
                                 f"{fa}; false rejects {gate['false_reject_rate']:.3f}",
                                 {"met": True, "missed": False}.get(gate["decision"]), status=gate["decision"],
                                 n=gate["pairs"]))
    return [table], [_bench_figure(rows, about, out_dir, task)] if rows else [], head


TTFT_FILE = "smollm2/pair_ttft.json"
TTFT_METHODS = ("raw", "kivi4", "droidspeak")  # DroidSpeak at its 15-layer block, the one at the oracle's quality
TTFT_COMMAND = ("kvstate transfer ttft --producer models/smollm2-135m-instruct --consumer models/smollm2-135m-ft "
                "--codec models/codec-smollm2-135m-ft --rate 1 --length 8128 --repeats 5 --methods "
                f"{','.join(TTFT_METHODS)} --options droidspeak.block=5:20 --seed SEED "
                "--out models/smollm2/pair_ttft.json")


def ttft(models_dir: Path) -> tuple[list[Table], list[HeadlineRow]]:
    """The real pair's time to first token (``pair_ttft.json``, ``kvstate transfer ttft``): the table and, per
    method, warm against the oracle (the toy pairs' rule: the repeats' min / max decide) and cold against it."""
    from kvstate.lab import stats
    from kvstate.lab.transfer import ttft_table as toy

    art = load_artifact(models_dir / TTFT_FILE, TTFT_COMMAND)
    if art.run is None:
        return [], [artifact_row(art, WHERE, "warm TTFT >= 2x faster than the oracle at 8K on 1 Gbit/s", "")]
    run = art.run
    rows: list[HeadlineRow] = []
    cells = toy.ttft_cells(run)
    length = max((n for _, n, _ in cells), default=toy.TTFT_LENGTH)
    oracle = cells.get((toy.REFERENCE, length, toy.TTFT_RATE))
    for m in sorted({m for m, _, _ in cells} - {toy.REFERENCE}):
        me = cells.get((m, length, toy.TTFT_RATE))
        if me is None or oracle is None:
            continue
        for mode, factor, what in (("warm", toy.TTFT_FACTOR, f">= {toy.TTFT_FACTOR:g}x faster than"),
                                   ("cold", 1.0, "no slower than")):
            label = f"{m} {mode} TTFT {what} the oracle at {length:,} tokens on the {toy.TTFT_RATE} Gbit/s link"
            try:
                o = stats.timing_row(oracle["cold"], oracle["cold_range"], oracle.get("n"), what="oracle TTFT")
                t = stats.timing_row(me[mode], me[f"{mode}_range"], me.get("n"), what=f"{m} {mode} TTFT")
            except Exception as exc:  # too few repeats or no spread: not decided
                rows.append(artifact_row(art, WHERE, label, f"not decided: {exc}", status="undecided"))
                continue
            lo, hi = o.lo / t.hi, o.hi / t.lo
            rows.append(artifact_row(art, WHERE, label, f"{o.value / t.value:.2f}x (oracle {o.value:.0f} ms, {m} "
                                     f"{t.value:.0f} ms; {lo:.2f}x-{hi:.2f}x over the repeats' min / max)",
                                     status=stats.decide(lo, hi, factor), repeats=me.get("n"), ci=(lo, hi)))
    return [toy.ttft_table(run, "real pair")], rows


PPL_FILE = "smollm2/pair_ppl.json"
PPL_COMMAND = ("OMP_NUM_THREADS=1 python -m kvstate.lab.transfer.realpair_ppl --n 100 --seed SEED "
               "--out models/smollm2/pair_ppl.json")


def _ppl_figure(rows: list[dict[str, Any]], agree: dict[str, dict[str, Any]], limit: float | None,
                out_dir: Path) -> Figure:
    fig, axes = plots.figure(0.6, 3.0)
    ax = axes[0][0]
    for r in rows:
        if "ratio" not in r or r["method"] not in agree or not agree[r["method"]].get("ci"):
            continue
        a = agree[r["method"]]
        ax.errorbar([r["ratio"]], [a["value"]],
                    xerr=[[r["ratio"] - r["ratio_ci"][0]], [r["ratio_ci"][1] - r["ratio"]]],
                    yerr=[[a["value"] - a["ci"][0]], [a["ci"][1] - a["value"]]], fmt="o", ms=4, capsize=2)
        ax.annotate(r["method"], (r["ratio"], a["value"]), fontsize=6, xytext=(3, 2), textcoords="offset points")
    if limit is not None:
        ax.axvline(limit, color="grey", ls="--", lw=0.8, label=f"target <= {limit:g}x")
        ax.legend(fontsize=7)
    ax.set_xlabel("held-out perplexity / the oracle's (paired)")
    ax.set_ylabel("greedy agreement with the oracle")
    name = plots.save(fig, out_dir, "smollm2_pair_ppl.png")
    return Figure("The real pair: each transfer's held-out perplexity ratio against its greedy agreement with the "
                  "consumer's own prefill", name, "95% intervals over the windows (paired for the ratio)")


def ppl(models_dir: Path) -> tuple[list[Table], list[HeadlineRow]]:
    """Held-out perplexity under transfer (``pair_ppl.json``): the table and one headline row per method (its
    paired perplexity ratio to the oracle's against the pre-registered +3%, decided by the run); its figure:
    :func:`ppl_figures`."""
    art = load_artifact(models_dir / PPL_FILE, PPL_COMMAND)
    if art.run is None:
        return [], [artifact_row(art, WHERE, "held-out perplexity under the best transfer <= 1.03x the oracle's", "")]
    from kvstate.lab.report.ppl_rows import headline, ppl_rows, seeds

    run, body, head = art.run, [], []
    exp = run.get("experiment") or {}
    for p in ppl_rows(art):
        r, a = p.row, p.score
        body.append([p.method, p.perplexity, p.ratio,
                     f"{a['value']:.2f} [{a['ci'][0]:.2f}, {a['ci'][1]:.2f}]" if a and a.get("ci") else "",
                     f"{r['first_divergence']:.1f}", f"{r['bf16_share']:.2f}" if "bf16_share" in r else "1 (own)",
                     f"{r['recomputed']:.0f}" if "recomputed" in r else "30 (all)", str(r["windows"]), seeds(art),
                     art.status])
        head += [h for h in [headline(art, WHERE, p, "")] if h is not None]
    settings = (run.get("provenance") or {}).get("settings") or {}
    table = Table("Real pair: held-out perplexity and greedy continuation under transfer, against the consumer's "
                  "own prefill", ["method", "perplexity [95%]", "ratio to the oracle [95%, paired]",
                                  "greedy agreement [95%]", "first divergence (tokens)", "bytes / bf16 cache",
                                  "layers recomputed", "windows", "seed", "file"], body,
                  f"windows of {settings.get('text', 'held-out text')}: {', '.join(str(x) for x in exp.get('lengths', []))}"
                  f" context tokens from the transferred cache, then the {settings.get('continuation', '')}-token continuation "
                  "fed through it (its first token has no logits from the cache: the rest are scored); "
                  f"greedy agreement is the share of {settings.get('greedy', '')} greedy tokens equal to the oracle's at "
                  "the same position")
    return [table], head


FLOPS_BUDGET, BYTES_BUDGET = 0.25, 0.25  # issue 44's budget: <= 25% of the consumer's prefill FLOPs, <= 1/4 of bf16
CLAIM = ("[real pair] the best transfer within the budget (<= 25% of the consumer's prefill FLOPs, <= 1/4 of bf16 "
         "bytes) >= 0.95x the oracle on every task class it solves and held-out perplexity <= 1.03x")


def _legs(models_dir: Path) -> tuple[list[Any], dict[str, dict[str, Any]], dict[str, list[tuple[str, str]]]]:
    """Every file the claim reads, each method's cost (the needle benches' appendices, the larger where they
    differ) and its decided legs:
    ``method -> [(leg, status)]`` — one per task class the oracle solves (a decision with a value) and one for
    held-out perplexity."""
    arts = [load_artifact(models_dir / f, bench_command(t)) for t, f in BENCH_FILES.items()]
    arts.append(load_artifact(models_dir / PPL_FILE, PPL_COMMAND))
    cost: dict[str, dict[str, Any]] = {}
    legs: dict[str, list[tuple[str, str]]] = {}
    for (task, _), art in zip(BENCH_FILES.items(), arts[:-1], strict=True):
        run = art.run or {}
        for m, c in (((run.get("appendix") or {}).get("methods")) or {}).items():  # the dearest file's cost
            was = cost.setdefault(m, {"flops_share": 0.0, "bf16_share": 0.0})
            for k in was:
                was[k] = max(was[k], c.get(k, 1.0))
        for d in run.get("decisions") or []:
            if d.get("value") is not None and d.get("method"):
                legs.setdefault(d["method"], []).append((task, d["status"]))
    for r in ((arts[-1].run or {}).get("appendix") or {}).get("rows") or []:
        if "status" in r:
            legs.setdefault(r["method"], []).append(("perplexity", r["status"]))
    return arts, cost, legs


def claim(models_dir: Path) -> list[HeadlineRow]:
    """Issue 44's claim as one row, composed from the decisions the runs recorded (nothing re-decided): among the
    methods inside the budget, met if one meets every leg, missed if every one misses a leg (or none fits the
    budget), undecided otherwise. The row's file is the first of the three that is not current, else the needle
    bench's."""
    arts, cost, legs = _legs(models_dir)
    art = next((a for a in arts if a.status != "current"), arts[0])
    if any(a.run is None for a in arts):
        return [artifact_row(art, WHERE, CLAIM, "")]
    inside = sorted(m for m, c in cost.items()
                    if c.get("flops_share", 1.0) <= FLOPS_BUDGET and c.get("bf16_share", 1.0) <= BYTES_BUDGET)
    needed = {leg for got in legs.values() for leg, _ in got}  # the solved task classes and perplexity
    verdicts = {}
    for m in inside:  # a leg the runs did not decide for a method (not measured, undecided) leaves it undecided
        got = dict(legs.get(m, []))
        verdicts[m] = ("missed" if "missed" in got.values() else
                       "met" if needed and all(got.get(leg) == "met" for leg in needed) else "undecided")
    status = ("met" if "met" in verdicts.values() else
              "missed" if all(v == "missed" for v in verdicts.values()) else "undecided")
    shown = "; ".join(f"{m} ({cost[m]['flops_share']:.0%} FLOPs, {cost[m]['bf16_share']:.2f} of bf16): "
                      + ", ".join(f"{leg} {s}" for leg, s in legs.get(m, [])) for m in inside)
    shown = shown or "no method fits the budget"
    outside = sorted(m for m in cost if m not in inside and legs.get(m)
                      and all(s != "missed" for _, s in legs[m]))
    if outside:
        shown += " — outside the budget, not missed: " + ", ".join(
            f"{m} ({cost[m]['flops_share']:.0%} FLOPs, {cost[m]['bf16_share']:.2f} of bf16)" for m in outside)
    seeds = sorted({s for a in arts for s in ((a.run or {}).get("experiment") or {}).get("seeds", [])})
    return [artifact_row(art, WHERE, CLAIM, shown, status=status, seeds=seeds)]


def build(models_dir: Path, out_dir: Path) -> tuple[list[Table], list[Figure], list[HeadlineRow]]:
    tables, figures, head = _premise(models_dir, out_dir)
    head = claim(models_dir) + head
    for task in BENCH_FILES:
        bt, bf, bh = bench(models_dir, out_dir, task)
        tables, figures, head = tables + bt, figures + bf, head + bh
    tt, th = ttft(models_dir)
    pt, ph = ppl(models_dir)
    return tables + tt + pt, figures + ppl_figures(models_dir, out_dir), head + th + ph


def ppl_figures(models_dir: Path, out_dir: Path) -> list[Figure]:
    """The perplexity run's figure (none while its file is missing)."""
    art = load_artifact(models_dir / PPL_FILE, PPL_COMMAND)
    if art.run is None:
        return []
    run = art.run
    appendix = run.get("appendix") or {}
    agree = {r["method"]: r for r in run.get("rows") or []}
    return [_ppl_figure(appendix.get("rows") or [], agree, appendix.get("limit"), out_dir)]


def _premise(models_dir: Path, out_dir: Path) -> tuple[list[Table], list[Figure], list[HeadlineRow]]:
    art = load_artifact(models_dir / FILE, COMMAND)
    if art.run is None:
        return [], [], [artifact_row(art, WHERE, "raw reuse <= 0.8x the oracle on the tasks it solves (the premise)",
                                     "")]
    run = art.run
    rows = run.get("rows") or []
    seeds = ", ".join(str(s) for s in (run.get("experiment") or {}).get("seeds", []))
    table = Table(f"Real pair at {', '.join(str(x) for x in (run.get('experiment') or {}).get('lengths', []))} tokens: "
                  "the consumer from its own prefill (oracle), from the producer's raw cache, and the producer itself",
                  ["method", "task", "score [95%] (n)", "seed", "file"],
                  [[r["method"], r["task"], f"{r['value']:.2f} [{r['ci'][0]:.2f}, {r['ci'][1]:.2f}] ({r['n']})", seeds,
                    art.status] for r in rows],
                  "RULER string_match_all over greedy replies; the consumer answers in JSON, the producer in a sentence")
    head = [artifact_row(art, WHERE, d["label"], f"{d['value']:+.3f} [{d['ci'][0]:+.3f}, {d['ci'][1]:+.3f}]",
                         **headline_fields(d))
            for d in run.get("decisions") or [] if d.get("value") is not None]
    tables, figures = [table], []
    drift = (run.get("appendix") or {}).get("drift") or {}
    if drift:
        step = max(1, len(drift["drift_k"]) // 10)
        shown = list(range(0, len(drift["drift_k"]), step))
        tables.append(Table("Real pair: per-layer cosine of the cached K and V, producer vs consumer",
                            ["", *(str(i) for i in shown)],
                            [["K", *(f"{drift['drift_k'][i]:.3f}" for i in shown)],
                             ["V", *(f"{drift['drift_v'][i]:.3f}" for i in shown)]],
                            f"every {step} layers of {len(drift['drift_k'])}; {drift['items']} items"))
        figures.append(_figure(drift, out_dir))
    return tables, figures, head


__all__ = ["CLAIM", "build", "claim"]
