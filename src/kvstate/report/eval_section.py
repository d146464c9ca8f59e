"""Report section: full-cache scores of the committed reference models (issue 4) on the synthetic tasks.

Every later technique is compared against these numbers, so they are measured again on each report run
(seeded, so the rows are reproducible): scores per task × length, a needle-depth × length heatmap, and
each model's learning curve read from its ``training_state.json`` (gate-task exact match on training batches).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from kvstate.eval.harness import load_reference, run_tasks
from kvstate.report.html import Figure, Section, Table

TASKS = ["niah_single", "niah_multikey", "vt", "qa"]
LENGTHS = [256, 512, 1024]
N = 8
SEED = 1234  # held-out examples (training draws from another seed stream)


def reference_dirs(models_dir: Path) -> list[Path]:
    if not models_dir.is_dir():
        return []
    return sorted(p for p in models_dir.iterdir() if (p / "config.json").is_file() and (p / "tokenizer.json").is_file())


def curve_figure(dirs: list[Path], out_dir: Path) -> Figure | None:
    """Gate-task exact match (training batches) and curriculum length against training minutes, per model."""
    curves = {}
    for d in dirs:
        state = d / "training_state.json"
        if state.is_file():
            curves[d.name] = json.loads(state.read_text()).get("curve", [])
    curves = {k: v for k, v in curves.items() if v}
    if not curves:
        return None
    fig, axes = plt.subplots(1, len(curves), figsize=(5.5 * len(curves), 3.5), squeeze=False)
    for ax, (name, curve) in zip(axes[0], curves.items(), strict=True):
        minutes = [p["minutes"] for p in curve]
        for task in ("niah_single", "niah_multikey"):
            ax.plot(minutes, [p["exact"].get(task, np.nan) for p in curve], label=f"{task} exact", lw=1)
        ax.axhline(0.9, color="grey", lw=0.6, ls=":")
        ax.set_ylim(0, 1.02)
        ax.set_xlabel("training minutes")
        ax.set_ylabel("exact match (training batches)")
        twin = ax.twinx()
        twin.step(minutes, [p["length"] for p in curve], where="post", color="black", lw=0.8, ls="--", label="length")
        twin.set_yscale("log", base=2)
        twin.set_ylabel("curriculum length (tokens)")
        ax.set_title(name)
        ax.legend(loc="upper left", fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "eval_learning_curves.png", dpi=100)
    plt.close(fig)
    return Figure("Learning curves of the reference models", "eval_learning_curves.png",
                  "Rolling exact match of the gate tasks on fresh training batches (before each update); dashed: "
                  "curriculum length; dotted: the 0.9 gate. Jumps are resumed parts that changed the recipe "
                  "(see the model cards).")


def build(out_dir: Path, models_dir: Path) -> Section:
    dirs = reference_dirs(models_dir)
    rows: list[list[Any]] = []
    figures: list[Figure] = []
    summary: dict[str, Any] = {"tasks": TASKS, "lengths": LENGTHS, "n": N, "seed": SEED, "models": {}}
    for d in dirs:
        model, tokenizer = load_reference(d)
        result = run_tasks(model, tokenizer, TASKS, LENGTHS, N, SEED)
        for r in result.scores():
            rows.append([d.name, r.task, r.length, r.n, r.score, r.cache_bytes, r.prefill_s])
        summary["models"][d.name] = result.as_json(d.name)["results"]
        grid = result.depth_grid("niah_single", bins=4)
        fig, ax = plt.subplots(figsize=(5, 3.5))
        data = np.array([[np.nan if v is None else v for v in row] for row in grid.scores], dtype=float)
        im = ax.imshow(data, vmin=0, vmax=1, cmap="viridis", aspect="auto", origin="lower")
        ax.set_xticks(range(len(grid.lengths)), [str(x) for x in grid.lengths])
        ax.set_yticks(range(len(grid.depths)), [f"{x:.2f}" for x in grid.depths])
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("needle depth")
        ax.set_title(f"{d.name}: niah_single exact match")
        fig.colorbar(im)
        fig.tight_layout()
        name = f"eval_{d.name}_depth.png"
        fig.savefig(out_dir / name, dpi=100)
        plt.close(fig)
        figures.append(Figure(f"{d.name}: needle depth × length", name, f"{N} seeded examples per length, full cache."))
    curves = curve_figure(dirs, out_dir)
    figures += [curves] if curves else []
    intro = (f"Full-cache scores on {N} held-out examples per task and length (seed {SEED}), greedy decoding."
             if dirs else f"No reference model with a tokenizer under {models_dir}/ yet.")
    return Section(
        key="eval",
        title="Reference models: full-cache task scores",
        intro=intro,
        tables=[Table("Scores per task and length", ["model", "task", "length", "n", "score", "cache bytes",
                                                     "prefill s"], rows)] if rows else [],
        figures=figures,
        summary=summary,
    )
