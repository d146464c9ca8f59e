"""Report part: R-CLA and CLA2 fine-tunes of the real model (SmolLM2-135M-Instruct), the dev-seed pilots.

Technique: Random Cross-Layer Attention ("Stochastic KV Routing") against the fixed CLA2 specialist ("Reducing
Transformer Key-Value Cache Size with Cross-Layer Attention"), both LoRA fine-tunes made by
:mod:`kvstate.lab.depth.realtrain`. Reads ``docs/results/smollm2_depth_ft_pilot.json`` (the newest run of
:mod:`kvstate.lab.depth.rcla_eval`: every fine-tuned model on its own K/V and under each pattern of the declared
keep-0.5 family, against the unmodified model; ``..._nearest.json`` the second round, R-CLA over nearest-owner
draws) and ``docs/results/smollm2_depth_ft_pilot_curves.json`` (the
runs' training curves, :func:`kvstate.lab.depth.realtrain.curves`). Both are dev-seed pilots: shown as a table
and a figure labelled so, never as a headline row.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvstate.lab.provenance import load_artifact
from kvstate.lab.report import plots
from kvstate.lab.report.html import Figure, Table

EVAL = "smollm2_depth_ft_pilot.json"
EVAL_NEAREST = "smollm2_depth_ft_pilot_nearest.json"  # the second pilot round: R-CLA over nearest-owner draws
EVAL_FAMILY = "smollm2_depth_ft_pilot_family.json"  # and R-CLA over the declared family (a uniform draw of 4 patterns)
PPL = "smollm2_depth_ft_ppl_pilot.json"  # held-out perplexity of the pilots (kvstate.lab.depth.real_ppl)
PPL_COMMAND = ("OMP_NUM_THREADS=1 python -m kvstate.lab.depth.real_ppl --model NAME=runs/depth/pilot-NAME-model "
               "--n 12 --seed SEED --out docs/results/" + PPL)
CURVES = "smollm2_depth_ft_pilot_curves.json"
COMMAND = ("OMP_NUM_THREADS=1 python -m kvstate.lab.depth.rcla_eval --model NAME=runs/depth/pilot-NAME-model "
           "--n 10 --seed SEED --out docs/results/FILE")


def build(models_dir: Path, out_dir: Path) -> tuple[list[Table], list[Figure]]:
    results = models_dir.parent / "docs" / "results"
    tables = [t for t in (*(_table(results / f) for f in (EVAL, EVAL_NEAREST, EVAL_FAMILY)), _ppl(results / PPL))
              if t is not None]
    figures = [f for f in (_curves(results / CURVES, out_dir),) if f is not None]
    return tables, figures


def _table(path: Path) -> Table | None:
    art = load_artifact(path, COMMAND.replace("FILE", path.name))
    if art.run is None:  # a dev-seed pilot: shown where it was run, not asked for
        return None
    s = (art.run.get("appendix") or {}).get("summary") or {}
    diff = {(p["method"], p["cell"]): p for p in s.get("pairs") or []}
    seeds = ", ".join(str(x) for x in (art.run.get("experiment") or {}).get("seeds", []))
    rows = []
    for r in s.get("rows") or []:
        d = diff.get((r["method"], r["cell"]))
        rows.append([r["method"], r["cell"], f"{r['score']:.2f} [{r['ci'][0]:.2f}, {r['ci'][1]:.2f}] ({r['n']})",
                     "" if d is None else f"{d['difference']:+.2f} [{d['ci'][0]:+.2f}, {d['ci'][1]:+.2f}]",
                     seeds, art.status])
    fam = "; ".join(f"{name}: own K/V {m['own_kv']:.2f}, keep-0.5 family worst {m['worst'].split(':', 1)[1]} "
                    f"{m['worst_score']:.2f}, mean {m['mean']:.2f}" for name, m in (s.get("models") or {}).items())
    return Table("Real model, fine-tuned for cross-layer sharing (dev-seed pilot, not a result): R-CLA and the "
                 "CLA2 specialist under the declared keep-0.5 family, against the unmodified model",
                 ["method", "cell", "score [95%] (n)", "vs unmodified (paired)", "dev seed", "file"], rows,
                 f"Pooled over the cells the unmodified model solves ({', '.join(s.get('solved') or []) or 'none'}): "
                 f"unmodified {s.get('reference', 0):.2f}; {fam}. Family: keep@0.5 (= CLA2 on 30 layers), "
                 "top_shared@0.5 and seeded R-CLA draws, 15 of 30 layers owning K/V each. LoRA fine-tunes of a "
                 "pilot's budget (see the curves); post hoc the unmodified model scores 0.00 under every keep-0.5 "
                 "pattern (docs/results/smollm2_depth_posthoc_pilot.json).")


def _ppl(path: Path) -> Table | None:
    art = load_artifact(path, PPL_COMMAND)
    if art.run is None:
        return None
    s = (art.run.get("appendix") or {}).get("summary") or {}
    rows = [[r["method"], f"{r['ppl']:.3f} [{r['ci'][0]:.3f}, {r['ci'][1]:.3f}] ({r['windows']})",
             f"{r['ratio']:.3f}x [{r['ratio_ci'][0]:.3f}, {r['ratio_ci'][1]:.3f}]" if "ratio" in r else "1",
             art.status] for r in s.get("rows") or []]
    return Table("Real model, fine-tuned for cross-layer sharing (dev pilot): held-out perplexity on its own K/V and "
                 "under each keep-0.5 pattern, against the unmodified model",
                 ["method", "perplexity [95%] (windows)", "vs unmodified (paired ratio)", "file"], rows,
                 "Windows of 512 tokens of the held-out licence text (never a haystack); issue 45's targets: keep 0.5 "
                 "<= 1.05x the unmodified model, keep 1 within 1%.")


def _curves(path: Path, out_dir: Path) -> Figure | None:
    if not path.is_file():
        return None
    runs: dict[str, Any] = json.loads(path.read_text()).get("runs") or {}
    if not runs:
        return None
    fig, grid = plots.figure(1.0, 3.0, ncols=2)
    axes = grid[0]
    for name, r in runs.items():
        pts = r.get("curve") or []
        tok = [p["tokens"] / 1000 for p in pts]
        axes[0].plot(tok, [p["prompt_kl"] for p in pts], "-", label=name)
        axes[1].plot(tok, [p["reply_ce"] for p in pts], "-", label=name)
    axes[0].set(xlabel="training tokens (thousands)", ylabel="KL to the unmodified model (prompt)", yscale="log")
    axes[1].set(xlabel="training tokens (thousands)", ylabel="reply cross-entropy (nats)", yscale="log")
    axes[0].legend()
    name = plots.save(fig, out_dir, "smollm2_depth_ft_curves.png")
    return Figure("Pilot fine-tunes of the real model under cross-layer sharing (dev seed): the routed student's KL "
                  "to the unmodified model on the prompt, and its cross-entropy on the reply", name,
                  "R-CLA draws a new pattern per row (p annealed from 1 to 0.5 over the first 30%; rcla: the owner "
                  "rule, a routed layer reads any earlier owner; nearest: it reads the closest owner below; family: a "
                  "uniform draw of the 4 declared keep-0.5 patterns, no anneal); CLA2 shares layer 2i+1 with layer "
                  "2i at every step.")


__all__ = ["build"]
