"""Report section: full-cache scores of the committed reference models on the RULER-shaped synthetic tasks.

Every later technique is compared against these numbers: scores per task × length, the needle-retrieval gate
(exact match >= 0.9 on ``niah_single`` and ``niah_multikey`` at 1,024 tokens, decided on Wilson intervals of
100 items), a needle-depth × length heatmap, and each model's learning curve read from its
``training_state.json``. The scores are two experiments of the one loop (:mod:`kvstate.lab.experiment`)
committed per model in ``models/<model>/reference_eval.json`` (``python -m kvstate.lab.report.eval_section
--model DIR``, about 5 minutes a model on one thread) and read here, so the report itself stays cheap; a
model without the file, or whose file is stale, shows the command that regenerates it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from kvstate.lab import protocol, stats
from kvstate.lab.harness import EvalResult, ExampleResult
from kvstate.lab.provenance import Artifact, load_artifact
from kvstate.lab.report import plots
from kvstate.lab.report.html import Figure, HeadlineRow, Section, Table, artifact_row, pivot
from kvstate.lab.training.io import read_state

TASKS = ["niah_single", "niah_multikey", "vt", "qa"]
LENGTHS = [256, 512, 1024]
N = 8
SEED = 1074  # held-out examples (training draws from another seed stream); 1235 before, spent by its runs
GATE_TASKS = ["niah_single", "niah_multikey"]
GATE_LENGTH = 1024
GATE_N = protocol.HEADLINE_N
GATE_THRESHOLD = 0.9
RESULT_FILE = "reference_eval.json"
SWEEP, GATE = "reference-sweep", "reference-gate"  # the two experiments in the file
CODE = ("models", "lab/harness.py", "lab/report/eval_section.py", "lab/scoring.py", "lab/workloads/tasks.py")
PAPER = "RULER: What's the Real Context Size of Your Long-Context Language Models? (the task shapes)"


def reference_dirs(models_dir: Path) -> list[Path]:
    """The reference models the synthetic tasks are for: not a converted pretrained model (``kvstate models
    convert``: a real tokenizer, real-text tasks), not a depth fine-tune."""
    if not models_dir.is_dir():
        return []
    return sorted(p for p in models_dir.iterdir() if (p / "config.json").is_file() and (p / "tokenizer.json").is_file()
                  and not _is_converted(p) and not _is_depth_run(p) and not _is_built(p))


def _is_built(p: Path) -> bool:
    """A fine-tune of the converted model rebuilt at set-up from a committed delta (the real pair's consumer,
    the depth fine-tunes): it records what it was built from, and real-text tasks are its reference."""
    return (p / "delta.json").is_file() or (p / "finetune.json").is_file()


def _is_converted(p: Path) -> bool:
    """A pretrained model converted by ``kvstate models convert`` (its manifest records the conversion)."""
    try:
        return "conversion" in json.loads((p / "manifest.json").read_text())
    except (OSError, ValueError):
        return False


def _is_depth_run(p: Path) -> bool:
    """Fine-tunes of a reference model by ``kvstate depth train``: the depth section reports them."""
    state = p / "training_state.json"
    return state.is_file() and "depth" in read_state(state)


def curve_figure(dirs: list[Path], out_dir: Path) -> Figure | None:
    """Gate-task exact match (training batches) and curriculum length against training minutes, per model."""
    curves = {}
    for d in dirs:
        state = d / "training_state.json"
        if state.is_file():
            curves[d.name] = read_state(state, ("curve[].minutes", "curve[].length", "curve[].exact")).get("curve", [])
    curves = {k: v for k, v in curves.items() if v}
    if not curves:
        return None
    fig, axes = plots.figure(min(1.0, 0.5 * len(curves)), 3.6, ncols=len(curves))
    for ax, (name, curve) in zip(axes[0], curves.items(), strict=True):
        minutes = [p["minutes"] for p in curve]
        for task, style in zip(GATE_TASKS, ("-", "-."), strict=True):
            ax.plot(minutes, [p["exact"].get(task, np.nan) for p in curve], style, color=plots.color(name),
                    label=f"{task} exact", lw=1)
        ax.axhline(GATE_THRESHOLD, color="grey", lw=0.6, ls=":")
        ax.set_ylim(0, 1.02)
        ax.set_xlabel("training time (minutes)")
        ax.set_ylabel("exact match (training batches)")
        twin = ax.twinx()
        twin.step(minutes, [p["length"] for p in curve], where="post", color="black", lw=0.8, ls="--")
        twin.set_yscale("log", base=2)
        twin.set_ylabel("curriculum length (tokens)")
        ax.set_title(name)
        ax.legend(loc="lower right", fontsize=7)
    name = plots.save(fig, out_dir, "eval_learning_curves.png")
    return Figure("Learning curves of the reference models", name,
                  "Rolling exact match of the gate tasks on fresh training batches (before each update); dashed: "
                  "curriculum length; dotted: the 0.9 gate. Jumps are resumed parts that changed the recipe "
                  "(see the model cards).")


def _score_figure(grids: dict[str, dict[tuple[str, int], float]], out_dir: Path) -> Figure:
    fig, axes = plots.figure(min(1.0, 0.5 * len(grids)), 3.4, ncols=len(grids))
    for ax, (model, cells) in zip(axes[0], grids.items(), strict=True):
        values = [[cells[(t, n)] for n in LENGTHS] for t in TASKS]
        if not plots.heatmap(ax, values, [f"{n:,}" for n in LENGTHS], TASKS, "context length (tokens)", "task",
                             cbar_label="score (exact match; F1 for qa)", vmin=0.0, vmax=1.0):
            plots.flat_panel(ax, f"every task and length scored {values[0][0]:.2f}")
        ax.set_title(model)
    name = plots.save(fig, out_dir, "eval_scores.png")
    return Figure("Full-cache score per task and context length", name,
                  f"{N} held-out examples per cell (seed {SEED}), greedy decoding; colour scale 0–1.")


def _depth_figure(grids: dict[str, Any], out_dir: Path) -> Figure | None:
    """niah_multikey score per needle depth × length; None when every cell of every model is equal."""
    values = {m: [[np.nan if v is None else v for v in row] for row in g.scores] for m, g in grids.items()}
    if plots.all_equal([row for v in values.values() for row in v]):
        return None
    fig, axes = plots.figure(min(1.0, 0.5 * len(grids)), 3.2, ncols=len(grids))
    for ax, (m, g) in zip(axes[0], grids.items(), strict=True):
        if not plots.heatmap(ax, values[m], [f"{n:,}" for n in g.lengths], [f"{d:.0%}" for d in g.depths],
                             "context length (tokens)", "needle depth (bin centre)", cbar_label="exact match",
                             vmin=0.0, vmax=1.0):
            flat = next(v for row in values[m] for v in row if not np.isnan(v))
            plots.flat_panel(ax, f"{flat:.2f} exact match at every\nneedle depth and length")
        ax.set_title(f"{m}: niah_multikey")
    name = plots.save(fig, out_dir, "eval_depth.png")
    bins = len(next(iter(grids.values())).depths)
    return Figure("Multi-key needle retrieval by needle depth and length", name,
                  f"{N} examples per length spread evenly over depth, {N // bins} per depth bin; colour scale 0–1.")


def command(model_dir: Path) -> str:
    return (f"OMP_NUM_THREADS=1 python -m kvstate.lab.report.eval_section --model {model_dir.as_posix()} --seed {SEED} "
            f"--out {(model_dir / RESULT_FILE).as_posix()}")


def experiments(model_dir: Path, seed: int = SEED) -> list[Any]:
    """The sweep (N per task x length) and the gate (GATE_N per gate task at GATE_LENGTH) on one model."""
    from kvstate.lab.experiment import Experiment

    # the ledger knows a method by name: the full cache on this model, per experiment (their tasks differ)
    common = dict(axis="reference", seeds=(seed,), code=CODE, models=(str(model_dir),))
    return [Experiment(name=SWEEP, methods=(f"{model_dir.name}:full:{SWEEP}",), tasks=tuple(TASKS),
                       lengths=tuple(LENGTHS), n=N, **common),
            Experiment(name=GATE, methods=(f"{model_dir.name}:full:{GATE}",), tasks=tuple(GATE_TASKS),
                       lengths=(GATE_LENGTH,), n=GATE_N, **common)]


def measure_reference(model_dir: Path, out: Path | None = None, seed: int = SEED) -> None:
    """Run both experiments on ``model_dir`` and append them to ``out`` (default: the model's result file)."""
    from kvstate.lab.experiment import Cell, Measurement, run
    from kvstate.lab.harness import load_reference, run_tasks

    model, tokenizer = load_reference(model_dir)

    def measure(cell: Cell) -> Measurement:
        res = run_tasks(model, tokenizer, [cell.task], [cell.length], cell.n, cell.seed)
        items = [{"depth": e.depth, "n_tokens": e.n_tokens, "score": e.score, "cache_bytes": e.cache_bytes,
                  "prefill_s": round(e.prefill_s, 4), "decode_s": round(e.decode_s, 4), "new_tokens": e.new_tokens}
                 for e in res.examples]
        return Measurement([e.score for e in res.examples], {"items": items})

    for e in experiments(model_dir, seed):
        run(e, measure, out=out or model_dir / RESULT_FILE, command=command(model_dir), progress=True)


def _result(run_doc: dict[str, Any]) -> EvalResult:
    """The per-item results of a committed experiment run, as the harness returns them."""
    res = EvalResult()
    for row in run_doc["rows"]:
        for i, item in enumerate(row["extra"]["items"]):
            res.examples.append(ExampleResult(row["task"], row["length"], i, prediction="", **item))
    return res


def _load(d: Path, name: str) -> Artifact:
    return load_artifact(d / RESULT_FILE, command(d),
                         select=lambda r: (r.get("experiment") or {}).get("name") == name)


def build(out_dir: Path, models_dir: Path) -> Section:
    dirs = reference_dirs(models_dir)
    if not dirs:
        return Section(key="eval", title="Reference models: full-cache scores on RULER-shaped tasks", paper=PAPER,
                       intro=f"No reference model with a tokenizer under {models_dir}/ yet.")
    records: list[dict[str, Any]] = []
    long_rows: list[list[Any]] = []
    grids: dict[str, dict[tuple[str, int], float]] = {}
    depth_grids: dict[str, Any] = {}
    headline: list[HeadlineRow] = []
    summary: dict[str, Any] = {"tasks": TASKS, "lengths": LENGTHS, "n": N, "seed": SEED, "models": {}, "gate": {}}
    target = (f"full-cache exact match >= {GATE_THRESHOLD:.2f} on {' and '.join(GATE_TASKS)} at {GATE_LENGTH:,} "
              "tokens (interval: the lower task)")
    for d in dirs:
        sweep, gate_art = _load(d, SWEEP), _load(d, GATE)
        if sweep.run is not None:
            result = _result(sweep.run)
            for r in result.scores():
                long_rows.append([d.name, r.task, r.length, r.n, r.score, r.cache_bytes, r.prefill_s])
                records.append({"task": r.task, "col": f"{d.name} @ {r.length:,}", "score": r.score})
            grids[d.name] = {(r.task, r.length): r.score for r in result.scores()}
            summary["models"][d.name] = result.as_json(d.name, detail=True)["results"]
            depth_grids[d.name] = result.depth_grid("niah_multikey", bins=4)
        if gate_art.run is None:
            headline.append(artifact_row(gate_art, f"reference model {d.name}", target, ""))
            continue
        gate = _result(gate_art.run)
        est = {t: stats.rate([e.score for e in gate.examples if e.task == t and e.length == GATE_LENGTH], seed=SEED)
               for t in GATE_TASKS}
        status = protocol.combine_status([stats.decide(e.lo, e.hi, GATE_THRESHOLD) for e in est.values()])
        worst = min(est.values(), key=lambda e: e.lo)
        summary["gate"][d.name] = {**{t: round(e.value, 3) for t, e in est.items()},
                                   "ci": {t: [round(e.lo, 3), round(e.hi, 3)] for t, e in est.items()},
                                   "n": GATE_N, "length": GATE_LENGTH, "threshold": GATE_THRESHOLD,
                                   "status": status, "file": gate_art.path, "file_status": gate_art.status}
        headline.append(artifact_row(gate_art, f"reference model {d.name}", target,
                                     " / ".join(f"{est[t].value:.2f}" for t in GATE_TASKS) + f" (n = {GATE_N} each)",
                                     status=status, ci=(worst.lo, worst.hi), rate=True, n=GATE_N,
                                     tasks=tuple(GATE_TASKS), excluded_tasks={}))
    figures = [_score_figure(grids, out_dir)] if grids else []
    depth = _depth_figure(depth_grids, out_dir) if depth_grids else None
    figures += [depth] if depth else []
    curves = curve_figure(dirs, out_dir)
    figures += [curves] if curves else []
    bytes_at = {d.name: next(r[5] for r in long_rows if r[0] == d.name and r[2] == LENGTHS[-1])
                for d in dirs if d.name in grids}
    summary["cache_bytes_at_longest"] = bytes_at
    return Section(
        key="eval",
        title="Reference models: full-cache scores on RULER-shaped tasks",
        paper=PAPER,
        conclusion=_conclusion(summary, grids, bytes_at, depth is None) if summary["gate"] and grids else
        "No committed reference_eval.json yet; the rows name the command that writes it.",
        intro=f"Full cache (transformers DynamicCache), greedy decoding, {N} held-out examples per task and "
        f"length (seed {SEED}); the gate uses {GATE_N} examples per task at {GATE_LENGTH:,} tokens. Exact match "
        "for the needle tasks and vt, token F1 for qa. These are the scores every cache technique is compared to. "
        f"Read from models/<model>/{RESULT_FILE} (each row names the file and its commit).",
        figures=figures,
        tables=[pivot(records, "task", "col", "score", "Score per task (rows) and model @ context length (columns)",
                      fmt=lambda v: f"{v:.2f}")] if records else [],
        details=[Table("Scores per model, task and length", ["model", "task", "length", "n", "score",
                                                              "cache bytes after prefill", "prefill s"], long_rows)],
        headline=headline,
        summary=summary,
    )


def _conclusion(summary: dict[str, Any], grids: dict[str, dict[tuple[str, int], float]],
                bytes_at: dict[str, float], depth_flat: bool) -> str:
    gate = summary["gate"]
    passed = [m for m, g in gate.items() if g["status"] == "met"]
    parts = [f"{len(passed)} of {len(gate)} reference models pass the retrieval gate at {GATE_LENGTH:,} tokens ("
             + "; ".join(f"{m}: " + " / ".join(f"{g[t]:.2f}" for t in GATE_TASKS) for m, g in gate.items()) + ")."]
    weak = [t for t in TASKS if t not in GATE_TASKS]
    if weak:
        best = max(v for cells in grids.values() for (t, _), v in cells.items() if t in weak)
        parts.append(f"{' and '.join(weak)} stay weak (at most {best:.2f} in any cell), so techniques are judged "
                     "on needle retrieval.")
    if len(bytes_at) > 1:
        small, large = min(bytes_at, key=bytes_at.__getitem__), max(bytes_at, key=bytes_at.__getitem__)
        parts.append(f"At {LENGTHS[-1]:,} tokens {small}'s cache holds {bytes_at[small] / 1e6:.2f} MB against "
                     f"{large}'s {bytes_at[large] / 1e6:.2f} MB.")
    if depth_flat:
        parts.append("Multi-key retrieval scored the same at every needle depth and length, so no depth heatmap "
                     "is shown.")
    return " ".join(parts)


def main(argv: list[str] | None = None) -> None:
    """``python -m kvstate.lab.report.eval_section --model DIR [--out FILE]``: write a model's reference scores."""
    import argparse

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=None, help=f"default: MODEL/{RESULT_FILE}")
    ap.add_argument("--seed", type=int, default=SEED, help=f"the held-out examples' seed (the report reads {SEED})")
    a = ap.parse_args(argv)
    measure_reference(a.model, a.out, a.seed)


if __name__ == "__main__":
    main()
