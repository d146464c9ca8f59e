"""Report section: cross-layer KV sharing and Random Cross-Layer Attention ("Stochastic KV Routing").

Reads the committed ``models/<name>/depth_eval.json`` files written by
``kvstate depth eval --model models/<name> --keep 1,0.75,0.5,0.25 --n 10 --json --out models/<name>/depth_eval.json``
(the measurement takes minutes per model, so the section only plots and checks it): quality (task
score and perplexity) against measured KV bytes per token, one curve per model — the base model with
sharing applied post hoc, the no-routing control, the CLA2 specialist and R-CLA — and one headline row
per target with the measured value.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from kvstate.lab import stats
from kvstate.lab.provenance import Artifact, load_artifact
from kvstate.lab.report.html import Figure, HeadlineRow, Section, Table, artifact_row

PAPER = "Stochastic KV routing: Random Cross-Layer Attention (R-CLA) for adaptive depth-wise KV cache sharing"

EVAL_FILE = "depth_eval.json"
TECH = "depth (cross-layer KV sharing, R-CLA)"
# model directory -> curve label; the R-CLA models are found by prefix
BASE, CONTROL, SPECIALIST, RCLA = "ref-attn", "ref-attn-norouting", "ref-attn-cla2", "ref-attn-rcla"
LABELS = {BASE: "base, sharing post hoc", CONTROL: "no-routing control (p=1)", SPECIALIST: "CLA2 specialist",
          RCLA: "R-CLA p=0.5", "ref-attn-rcla075": "R-CLA p=0.75"}
CLA2 = "0_0_2_2"
COLORS = dict(zip(LABELS, ("C0", "C1", "C2", "C3", "C4"), strict=True))  # one colour per model in every plot


def eval_command(name: str) -> str:
    """The command that regenerates ``models/<name>/depth_eval.json`` (a run appended to the file)."""
    return (f"kvstate depth eval --model models/{name} --keep 1,0.75,0.5,0.25 --n 25 --seed 1000 --json "
            f"--out models/{name}/{EVAL_FILE}")


def load_artifacts(models_dir: Path) -> dict[str, Artifact]:
    """Model name -> its committed ``depth_eval.json`` (the newest run) with its provenance status."""
    return {name: load_artifact(models_dir / name / EVAL_FILE, eval_command(name))
            for name in LABELS if (models_dir / name / EVAL_FILE).is_file()}


def load_results(models_dir: Path) -> dict[str, list[dict[str, Any]]]:
    """Model name -> result rows of its committed ``depth_eval.json`` (the newest run)."""
    return {name: a.run["results"] for name, a in load_artifacts(models_dir).items() if a.run is not None}


def _worst(arts: list[Artifact]) -> Artifact:
    """The artifact a row combining several files stands on: a stale or missing one if any."""
    return next((a for a in arts if a.status != "current"), arts[0])


def _ci(row: dict[str, Any] | None, key: str) -> tuple[float, float] | None:
    ci = (row or {}).get(key)
    return (float(ci[0]), float(ci[1])) if ci else None


def _at(rows: list[dict[str, Any]], *, keep: float | None = None, pattern: str | None = None) -> dict[str, Any] | None:
    for r in rows:
        if (keep is None or abs(r["keep"] - keep) < 1e-9) and (pattern is None or r["pattern"] == pattern):
            return r
    return None


def headline(res: dict[str, list[dict[str, Any]]], arts: dict[str, Artifact]) -> list[HeadlineRow]:
    rows: list[HeadlineRow] = []

    def add(target: str, measured: str, met: bool | None, names: tuple[str, ...] = (),
            ci: tuple[float, float] | None = None, status: str = "") -> None:
        used = [arts[n] for n in names if n in arts] or list(arts.values())
        if used:
            rows.append(artifact_row(_worst(used), TECH, target, measured, met, ci=ci, status=status,
                                     rate=ci is not None))
        else:
            missing = Artifact(f"models/{names[0] if names else RCLA}/{EVAL_FILE}", eval_command(names[0] if names else RCLA),
                               "missing", "file not found", None, 0)
            rows.append(artifact_row(missing, TECH, target, measured))

    rc, ctl, spec, base = res.get(RCLA), res.get(CONTROL), res.get(SPECIALIST), res.get(BASE)
    r1, r5 = (_at(rc, keep=1.0), _at(rc, keep=0.5)) if rc else (None, None)
    if r1 and r5:
        dp = r5["ppl"] / r1["ppl"] - 1
        ds = (r1["score"] - r5["score"]) * 100
        add("R-CLA keep 0.5 within 3% ppl of keep 1.0", f"{dp:+.1%} ({r5['ppl']:.2f} vs {r1['ppl']:.2f})", dp <= 0.03, (RCLA,))
        if r1.get("items") and r5.get("items") and len(r1["items"]) == len(r5["items"]):
            diff = stats.paired_difference(r5["items"], r1["items"])  # the same items under both patterns
            add("R-CLA keep 0.5 within 3 points score of keep 1.0 (paired interval)",
                f"{100 * diff.value:+.1f} points ({r5['score']:.3f} vs {r1['score']:.3f}, n = {diff.n})",
                None, (RCLA,), ci=(diff.lo, diff.hi), status=stats.decide(diff.lo, diff.hi, -0.03))
        else:
            add("R-CLA keep 0.5 within 3 points score of keep 1.0",
                f"{-ds:+.1f} points ({r5['score']:.3f} vs {r1['score']:.3f})", ds <= 3, (RCLA,))
    else:
        add("R-CLA keep 0.5 vs keep 1.0 (3% ppl, 3 points)", f"no {RCLA}/{EVAL_FILE}", None, (RCLA,))
    c1 = _at(ctl, keep=1.0) if ctl else None
    if r1 and c1:
        d = r1["ppl"] / c1["ppl"] - 1
        add("R-CLA keep 1.0 within 2% ppl of the no-routing control",
            f"{d:+.1%} ({r1['ppl']:.2f} vs {c1['ppl']:.2f}); score {r1['score']:.3f} vs {c1['score']:.3f}", abs(d) <= 0.02, (RCLA, CONTROL))
    else:
        add("R-CLA keep 1.0 within 2% of the no-routing control", "missing eval files", None, (RCLA, CONTROL))
    b1, b5 = (_at(base, keep=1.0), _at(base, keep=0.5)) if base else (None, None)
    if b1 and b5:
        d = b5["ppl"] / b1["ppl"] - 1
        add("post-hoc sharing of the base model measurably worse at keep <= 0.5",
            f"keep 0.5: ppl {d:+.0%} ({b5['ppl']:.1f} vs {b1['ppl']:.2f}), score {b5['score']:.3f} vs {b1['score']:.3f}",
            d > 0.03 or b1["score"] - b5["score"] > 0.03, (BASE,))
    else:
        add("post-hoc sharing of the base model measurably worse at keep <= 0.5", "missing eval file", None, (BASE,))
    rs, ss = (_at(rc, pattern=CLA2) if rc else None), (_at(spec, pattern=CLA2) if spec else None)
    if rs and ss:
        d = rs["ppl"] / ss["ppl"] - 1
        add(f"R-CLA within 2% ppl of the CLA2 specialist at {CLA2}", f"{d:+.1%} ({rs['ppl']:.2f} vs {ss['ppl']:.2f})",
            d <= 0.02, (RCLA, SPECIALIST))
        others = [r for r in spec if r["pattern"] != CLA2]
        worst = max(others, key=lambda r: r["ppl"]) if others else None
        if worst:
            d = worst["ppl"] / ss["ppl"] - 1
            add("the CLA2 specialist degrades at patterns it was not trained for",
                f"worst other pattern {worst['pattern']}: ppl {d:+.0%} ({worst['ppl']:.2f} vs {ss['ppl']:.2f})", d > 0.03,
                (SPECIALIST,))
    else:
        add(f"R-CLA within 2% of the CLA2 specialist at {CLA2}", "missing eval files", None, (RCLA, SPECIALIST))
    exact = [abs(r["kv_bytes_per_token"] - r["keep"] * _at(rows_, keep=1.0)["kv_bytes_per_token"]) < 1e-6
             for rows_ in res.values() if _at(rows_, keep=1.0) for r in rows_]
    if exact:
        add("KV bytes per token exactly proportional to kept layers (measured from cache tensors)",
            f"{sum(exact)}/{len(exact)} rows exact", all(exact), tuple(res))
    return rows


def notes(res: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Facts that cannot be missed: decode speed per keep (no target; a shared 2-core machine)."""
    name = RCLA if RCLA in res else next(iter(res), None)
    if name is None:
        return []
    return [f"decode tokens/s of {name} per keep: " + ", ".join(
        f"keep {r['keep']:g}: {r['decode_tok_s']:g}" for r in res[name]) + " (shared 2-core machine: noisy)"]


def _figure(res: dict[str, list[dict[str, Any]]], out_dir: Path) -> Figure:
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for name, rows in res.items():
        xs = [r["kv_bytes_per_token"] for r in rows]
        axes[0].plot(xs, [r["score"] for r in rows], marker="o", color=COLORS[name], label=LABELS[name])
        axes[1].plot(xs, [r["ppl"] for r in rows], marker="o", color=COLORS[name], label=LABELS[name])
    axes[0].set_ylabel("task score (needle tasks, 1K+2K)")
    axes[1].set_ylabel("perplexity (held-out text, 1K)")
    axes[1].set_yscale("log")
    for ax in axes:
        ax.set_xlabel("KV bytes per token (measured)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "depth_quality_vs_kv.png", dpi=100)
    plt.close(fig)
    return Figure("Quality against KV bytes per token", "depth_quality_vs_kv.png",
                  "One curve per model; points are keep 1, 0.75, 0.5, 0.25 (patterns 0_1_2_3, 0_1_2_2, 0_0_2_2, "
                  "0_0_0_0). Measured by kvstate depth eval (committed depth_eval.json).")


def _curves(models_dir: Path, out_dir: Path) -> Figure | None:
    """Loss of each depth run on its training batches (every route drawn counts), against steps since the start."""
    fig, ax = plt.subplots(figsize=(6, 3.5))
    drawn = False
    for name in LABELS:
        path = models_dir / name / "training_state.json"
        if name == BASE or not path.is_file():
            continue
        state = json.loads(path.read_text())
        depth = state.get("depth")
        if not depth:
            continue
        curve = [c for c in state["curve"] if c["step"] > depth["start_step"]]
        ax.plot([c["step"] - depth["start_step"] for c in curve], [c["loss"] for c in curve], marker=".",
                color=COLORS[name], label=LABELS[name])
        drawn = True
    if not drawn:
        plt.close(fig)
        return None
    ax.set_xlabel("steps since models/ref-attn")
    ax.set_ylabel("training loss (rolling)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "depth_learning_curves.png", dpi=100)
    plt.close(fig)
    return Figure("Learning curves of the depth runs", "depth_learning_curves.png",
                  "Answer-weighted loss on the training batches before each update, under each run's own routing "
                  "(R-CLA: a random pattern per step). models/ref-attn ended its own training near 0.6.")


def build(out_dir: Path, models_dir: Path) -> Section:
    arts = load_artifacts(models_dir)
    res = {name: a.run["results"] for name, a in arts.items() if a.run is not None}
    if not res:
        missing = Artifact(f"models/{RCLA}/{EVAL_FILE}", eval_command(RCLA), "missing", "file not found", None, 0)
        return Section(key="depth", title="Depth: cross-layer KV sharing and R-CLA", paper=PAPER,
                       intro=f"No {EVAL_FILE} under {models_dir}/; run kvstate depth eval --out.",
                       headline=[artifact_row(missing, TECH, "R-CLA targets", "")])
    table = Table("Sharing patterns per model", ["model", "keep", "pattern", "ppl", "score", "KV B/token", "decode tok/s"],
                  [[LABELS[n], r["keep"], r["pattern"], r["ppl"], r["score"], r["kv_bytes_per_token"], r["decode_tok_s"]]
                   for n, rows in res.items() for r in rows])
    intro = ("Random Cross-Layer Attention trains one model so that any cross-layer KV-sharing pattern works at "
             "deployment. The 4-layer reference attention model was fine-tuned from its committed checkpoint for the "
             "same steps and batches with R-CLA, without routing (control) and with the fixed CLA2 pattern "
             "(specialist); no deeper model was trained from scratch. Numbers are read from the committed "
             f"{EVAL_FILE} files (kvstate depth eval --n 10); the learning curves are in the model cards.")
    return Section(key="depth", title="Depth: cross-layer KV sharing and R-CLA", paper=PAPER, intro=intro, tables=[table],
                   figures=[_figure(res, out_dir), *filter(None, [_curves(models_dir, out_dir)])], summary={"results": res, "artifacts": {n: {"path": a.path, "status": a.status, "reason": a.reason,
                                                                       "provenance": a.provenance} for n, a in arts.items()}},
                   headline=headline(res, arts), notes=notes(res))
