"""Report section: the state each embedded model carries (layer kinds, KV vs recurrent checkpoint bytes).

The premise of "Sparse Prefix Caching for Hybrid and Recurrent LLM Serving", measured on our models: one
recurrent checkpoint costs as much as many tokens of attention KV, so checkpoints must be sparse. The byte
formulas (computed from each config) are checked here against the bytes of a real cache after a prefill,
for every model small enough to run (the reference models and the tiny test configs).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kvstate.lab.report import plots
from kvstate.lab.report.html import Figure, Section, Table, check_row
from kvstate.models import describe, qwen35_08b_config, segmented_prefill, tiny_config, tiny_model
from kvstate.models.loading import load_config, load_model

TINY_FAMILIES = ("llama", "qwen3", "qwen3_5", "qwen3_next", "mamba2", "bamba", "falcon_h1")
PAPER = "Sparse Prefix Caching for Hybrid and Recurrent LLM Serving"
QWEN = "Qwen3.5-0.8B shape (bf16)"
PREFILL = 24  # tokens of the prefill whose cache is measured


def embedded_configs(models_dir: Path) -> list[tuple[str, Any]]:
    """Reference models committed under ``models/`` (if any), Qwen3.5-0.8B's shape, the tiny test configs."""
    out: list[tuple[str, Any]] = []
    if models_dir.is_dir():
        for d in sorted(p for p in models_dir.iterdir() if (p / "config.json").is_file()):
            out.append((f"models/{d.name}", load_config(d)))
    out.append((QWEN, qwen35_08b_config()))
    out += [(f"tiny {f} (fp32)", tiny_config(f)) for f in TINY_FAMILIES]
    return out


@torch.no_grad()
def measured_bytes(model: Any, n: int = PREFILL) -> tuple[int, int]:
    """(attention KV bytes, recurrent bytes) of a real cache after an ``n``-token prefill."""
    ids = torch.randint(0, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
    snap = segmented_prefill(model, ids, cuts=[n]).snapshots[n]
    return snap.attention_nbytes, snap.recurrent_nbytes


def _model_for(name: str, models_dir: Path) -> Any | None:
    if name.startswith("models/"):
        return load_model(models_dir / name.removeprefix("models/"))
    if name.startswith("tiny "):
        return tiny_model(name.split()[1])
    return None  # Qwen3.5-0.8B itself is too large to instantiate here: formula only


def build(out_dir: Path, models_dir: Path) -> Section:
    rows, summary = [], {}
    checked = exact = 0
    for name, config in embedded_configs(models_dir):
        info = describe(config)
        kinds = info.layer_kinds
        mix = ", ".join(f"{kinds.count(k)} {k}" for k in ("attention", "recurrent", "hybrid", "none") if kinds.count(k))
        ratio = "—" if info.checkpoint_tokens is None else f"{info.checkpoint_tokens:,.0f}"
        model = _model_for(name, models_dir)
        match = "not run"
        summary[name] = info.as_json()
        if model is not None:
            kv, rec = measured_bytes(model)
            ok = kv == PREFILL * info.kv_bytes_per_token and rec == info.checkpoint_bytes
            checked, exact = checked + 1, exact + ok
            match = "yes" if ok else f"no: {kv:,} / {rec:,} B"
            summary[name].update(measured_kv_bytes=kv, measured_recurrent_bytes=rec, accounting_exact=ok)
        rows.append([name, mix, info.dtype, info.kv_bytes_per_token, info.checkpoint_bytes, ratio, match])
    summary["accounting_check"] = {"models": checked, "exact": exact, "prefill_tokens": PREFILL}
    fig = _plot(out_dir, summary)
    q = summary[QWEN]
    conclusion = (f"One recurrent checkpoint of Qwen3.5-0.8B ({q['dtype']}) holds {q['checkpoint_bytes']:,} B "
                  f"({q['checkpoint_bytes'] / 2**20:.1f} MiB), as much as {q['checkpoint_tokens']:,.0f} tokens of its "
                  f"attention KV ({q['kv_bytes_per_token']:,} B per token): a checkpoint per token would multiply "
                  f"the prefix's memory by {q['checkpoint_tokens']:,.0f}, so recurrent checkpoints must be sparse. "
                  f"The byte formulas matched a real cache exactly on {exact} of {checked} models.")
    return Section(
        key="model_state",
        title="Model state: attention KV vs recurrent checkpoints",
        paper=PAPER + " (its premise)",
        conclusion=conclusion,
        intro="Per model: the layer mix, attention KV bytes one token adds, bytes of one recurrent checkpoint "
        "(conv + recurrent state of every recurrent layer), and how many tokens of KV one checkpoint is worth, "
        f"computed from each config; 'matches a cache' compares them with the tensors of a real {PREFILL}-token "
        "prefill (Qwen3.5-0.8B is too large to run here: formula only).",
        figures=[fig],
        tables=[Table("Layer kinds and state bytes",
                      ["model", "layers", "dtype", "KV B/token", "checkpoint B", "checkpoint ≈ tokens of KV",
                       "matches a cache"], rows)],
        # the formulas count the tensors the cache allocates: a property of the code (tests/lib/models/
        # test_accounting.py asserts it per family and dtype), a check, not a result
        headline=[check_row("model state (byte accounting)",
                            "KV and checkpoint bytes from the config = bytes of a real cache",
                            checked > 0 and exact == checked,
                            "the byte formulas count the tensors the cache allocates for each layer kind (a test of "
                            "the code: tests/lib/models/test_accounting.py)",
                            f"{exact} of {checked} models exact")],
        summary=summary,
    )


def _plot(out_dir: Path, summary: dict[str, Any]) -> Figure:
    names = [n for n, s in summary.items() if isinstance(s, dict) and s.get("checkpoint_tokens")]
    names.sort(key=lambda n: summary[n]["checkpoint_tokens"])
    values = [summary[n]["checkpoint_tokens"] for n in names]
    fig, axes = plots.figure(0.8, 0.45 * len(names) + 1.2)
    ax = axes[0][0]
    ax.barh(names, values, color=[plots.color("optimal") if n == QWEN else "#999999" for n in names])
    for y, v in enumerate(values):
        ax.text(v * 1.05, y, f"{v:,.0f}", va="center", fontsize=9)
    ax.set_xscale("log")
    ax.set_xlim(min(values) / 2, max(values) * 4)
    ax.set_xlabel("tokens of attention KV with the bytes of one recurrent checkpoint (log scale)")
    name = plots.save(fig, out_dir, "model_state_bytes.png")
    return Figure("One recurrent checkpoint, in tokens of attention KV", name,
                  "Models with both kinds of state; attention-only models have no checkpoint, pure SSMs no KV.")
