"""Report part: the real cross-model pair (SmolLM2-135M-Instruct → its LoRA fine-tune) — does the producer's raw
K/V serve the consumer, and how far the consumer's cache drifted (Semantic Cache Distillation's premise,
``docs/techniques.md#across-models``; the pair: :mod:`kvstate.lab.transfer.realpair`).

Reads the committed ``models/smollm2/pair_premise.json`` (:mod:`kvstate.lab.transfer.realpair_eval`, newest run):
per task the oracle (the consumer's own prefill), raw reuse and the producer with intervals; the premise's
decision as a headline row; the per-layer K / V cosine between the two caches as a table and a figure. A missing
or stale file shows the command that writes it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvstate.lab.experiment import headline_fields
from kvstate.lab.provenance import load_artifact
from kvstate.lab.report import plots
from kvstate.lab.report.html import Figure, HeadlineRow, Table, artifact_row

FILE = "smollm2/pair_premise.json"
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


def build(models_dir: Path, out_dir: Path) -> tuple[list[Table], list[Figure], list[HeadlineRow]]:
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


__all__ = ["build"]
