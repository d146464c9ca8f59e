"""The model card of a trained SEKV router, generated from its manifest (never written by hand).

``write_card`` renders ``README.md`` next to ``router.safetensors`` from what the training run recorded:
the base model and its fingerprint, trainable parameters, steps, minutes, configuration and the loss
curve; and, when ``eval.json`` (``kvstate semantic eval --json --save``) is present, its results table.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvstate.io_safety import write_text_atomic
from kvstate.lab.provenance import read_runs


def _curve(history: list[dict[str, float]], rows: int = 12) -> list[str]:
    if not history:
        return ["(no logged steps)"]
    stride = max(1, len(history) // rows)
    picked = history[::stride][: rows - 1]
    if picked[-1] is not history[-1]:
        picked.append(history[-1])
    keys = ["step", "minutes", "loss", "distill", "zoom", "expand", "rec", "rank", "agree"]
    out = ["| " + " | ".join(keys) + " |", "|" + "---:|" * len(keys)]
    for h in picked:
        out.append("| " + " | ".join(f"{h[k]:.4g}" if isinstance(h[k], float) else str(h[k]) for k in keys) + " |")
    return out


def render_card(model_dir: Path, manifest: dict[str, Any], evaluation: dict[str, Any] | None = None) -> str:
    cfg = manifest["train_config"]
    rc = manifest["config"]
    lines = [
        f"# SEKV router for `{model_dir}`",
        "",
        "Routing projections, per-layer / per-head zoom thresholds and the rank-gate predictor of SEKV",
        "(\"SEKV: Resolution-Adaptive Semantic KV Cache with Hierarchical Semantic Memory\"), trained on the frozen",
        f"base model by `kvstate semantic train`. Base model fingerprint: `{manifest['fingerprint']}` (loading onto",
        "another model raises). This card is generated from `manifest.json` by `kvstate.lab.semantic.card`.",
        "",
        "| | |",
        "|---|---|",
        f"| routing space | {rc['routing_dim']} dims, {rc['n_layers']} layers x {rc['n_heads']} query heads |",
        f"| trainable parameters | {manifest['trainable_parameters']:,} "
        f"({100 * manifest['trainable_fraction']:.3f}% of base + router; base {manifest['base_parameters']:,}) |",
        f"| training | {manifest['steps']} steps in {manifest['minutes']} min, one example per step, "
        f"lengths {cfg['lengths']}, budget {cfg['budget']}, lr {cfg['lr']}, seed {cfg['seed']} |",
        f"| losses | distillation x{cfg['w_distill']}, zoom BCE x{cfg['w_zoom']} (target: span >= {cfg['mass']} of a "
        f"head's attention, pos_weight {cfg['pos_weight']}), reconstruction x{cfg['w_rec']}, expansion x{cfg['w_expand']}, "
        f"rank x{cfg['w_rank']} |",
        f"| tasks | {', '.join(cfg['tasks'])} (training seed stream) |",
        "",
        "## Training curve (means over 10-step windows; `agree` = student argmax equals teacher argmax)",
        "",
        *_curve(manifest.get("history", [])),
        "",
        "Command:",
        "",
        "```",
        f"kvstate semantic train --model {model_dir} --out <this dir> --minutes {cfg['minutes']} --budget {cfg['budget']} "
        f"--lengths {','.join(str(x) for x in cfg['lengths'])}",
        "```",
    ]
    if evaluation is not None:
        command = evaluation.get("command") or (evaluation.get("provenance") or {}).get("command", "")
        lines += ["", "## Evaluation (`eval.json`)", "", f"Command: `{command}`", "",
                  "Scores are accuracies, except task `ppl`: held-out perplexity (compress the context, then continue; "
                  "lower is better).", "",
                  "| method | budget | task | length | n | score | 95% CI | resident | total | attended peak | full | "
                  "ms / token |",
                  "|---|---:|---|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
        for r in evaluation["results"]:
            ci = r.get("score_ci")
            lines.append(f"| {r['method']} | {r['budget']} | {r['task']} | {r['length']} | {r.get('n', '')} | "
                         f"{r['score']:.3f} | {'' if ci is None else f'[{ci[0]:.3f}, {ci[1]:.3f}]'} | "
                         + " | ".join(f"{r[k]:,}" if k in r else "–" for k in
                                      ("resident_bytes", "total_bytes", "attended_bytes_peak", "full_bytes"))
                         + f" | {r['decode_ms_per_token']:.2f} |")
    return "\n".join(lines) + "\n"


def write_card(out_dir: Path, model_dir: Path, manifest: dict[str, Any] | None = None) -> Path:
    out_dir = Path(out_dir)
    if manifest is None:
        manifest = json.loads((out_dir / "manifest.json").read_text())
    else:
        manifest = {**json.loads((out_dir / "manifest.json").read_text()), **manifest}
    ev = out_dir / "eval.json"
    evaluation = read_runs(ev)[-1] if ev.is_file() else None
    path = out_dir / "README.md"
    write_text_atomic(path, render_card(model_dir, manifest, evaluation))
    return path
