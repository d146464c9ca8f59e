"""Report section: the state each embedded model carries (layer kinds, KV vs recurrent checkpoint bytes).

Seed 000's premise, measured on our models: one recurrent checkpoint costs as much as N tokens of
attention KV, so checkpoints must be sparse.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from kvstate.models import describe, qwen35_08b_config, tiny_config
from kvstate.models.loading import load_config
from kvstate.report.html import Figure, Section, Table

TINY_FAMILIES = ("llama", "qwen3", "qwen3_5", "qwen3_next", "mamba2", "bamba", "falcon_h1")


def embedded_configs(models_dir: Path) -> list[tuple[str, Any]]:
    """Reference models committed under ``models/`` (if any), Qwen3.5-0.8B's shape, the tiny test configs."""
    out: list[tuple[str, Any]] = []
    if models_dir.is_dir():
        for d in sorted(p for p in models_dir.iterdir() if (p / "config.json").is_file()):
            out.append((f"models/{d.name}", load_config(d)))
    out.append(("Qwen3.5-0.8B shape (bf16)", qwen35_08b_config()))
    out += [(f"tiny {f} (fp32)", tiny_config(f)) for f in TINY_FAMILIES]
    return out


def build(out_dir: Path, models_dir: Path) -> Section:
    rows, summary = [], {}
    for name, config in embedded_configs(models_dir):
        info = describe(config)
        kinds = info.layer_kinds
        mix = ", ".join(f"{kinds.count(k)} {k}" for k in ("attention", "recurrent", "hybrid", "none") if kinds.count(k))
        ratio = "—" if info.checkpoint_tokens is None else f"{info.checkpoint_tokens:,.0f}"
        rows.append([name, info.family, mix, info.dtype, info.kv_bytes_per_token, info.checkpoint_bytes, ratio,
                     info.chunk_size or "—"])
        summary[name] = info.as_json()
    fig = _plot(out_dir / "model_state_bytes.png", summary)
    return Section(
        key="model_state",
        title="Model state: attention KV vs recurrent checkpoints",
        intro="Per model: the layer mix, attention KV bytes one token adds, bytes of one recurrent checkpoint "
        "(conv + recurrent state of every recurrent layer), and how many tokens of KV one checkpoint is worth. "
        "Computed from each config; tests check these formulas against real caches.",
        tables=[Table("Layer kinds and state bytes",
                      ["model", "family", "layers", "dtype", "KV B/token", "checkpoint B", "checkpoint ≈ tokens of KV",
                       "chunk"], rows)],
        figures=[fig],
        summary=summary,
    )


def _plot(path: Path, summary: dict[str, dict[str, Any]]) -> Figure:
    names = [n for n, s in summary.items() if s["checkpoint_bytes"] and s["kv_bytes_per_token"]]
    tokens = list(range(64, 4097, 64))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for n in names:
        s = summary[n]
        (_line,) = ax.plot(tokens, [t * s["kv_bytes_per_token"] / s["checkpoint_bytes"] for t in tokens], label=n)
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_xlabel("prefix tokens of attention KV")
    ax.set_ylabel("KV bytes / one checkpoint's bytes")
    ax.set_yscale("log")
    ax.set_title("When does a prefix's KV outweigh one recurrent checkpoint?")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Figure("KV bytes of a prefix relative to one recurrent checkpoint", path.name,
                  "Below the dashed line one checkpoint costs more than the whole prefix's attention KV.")
