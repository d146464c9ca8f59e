"""Report part: depth on the real model (SmolLM2-135M-Instruct, 30 layers) — the training-free equal-bytes rival
of cross-layer KV sharing, xKV ("xKV: Cross-Layer SVD for KV-Cache Compression", :mod:`kvstate.depth.xkv`), at
half the bf16 cache (keep 0.5's bytes), and post-hoc sharing beside it where a run exists.

Reads the committed ``models/smollm2/depth_xkv.json`` (:mod:`kvstate.lab.depth.xkv_real`, newest run): per task
the full cache and each xKV row with intervals and the bytes held over a bf16 full cache; each pre-registered
target as a headline row. The dev-seed pilots (``docs/results/smollm2_depth_*``) are named in the note, not
shown. A missing or stale file shows the command that writes it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvstate.lab.experiment import headline_fields
from kvstate.lab.provenance import load_artifact
from kvstate.lab.report.html import HeadlineRow, Table, artifact_row

FILE = "smollm2/depth_xkv.json"
COMMAND = ("OMP_NUM_THREADS=1 python -m kvstate.lab.depth.xkv_real --rows 4@0.5 --n 100 --seed SEED "
           "--out models/smollm2/depth_xkv.json")
WHERE = "depth on the real model (xKV, training-free)"
FLOOR_AT, FLOOR = 0.5, 0.9


def build(models_dir: Path) -> tuple[list[Table], list[HeadlineRow]]:
    art = load_artifact(models_dir / FILE, COMMAND)
    if art.run is None:
        return [], [artifact_row(art, WHERE, "xKV at half the bf16 cache - full >= -0.05 on the solved tasks", "")]
    run = art.run
    held: dict[str, list[float]] = {}
    for it in run.get("items") or []:
        for m, h in ((it.get("extra") or {}).get("held") or {}).items():
            held.setdefault(m, []).append(float(h["bf16"]))
    seeds = ", ".join(str(s) for s in (run.get("experiment") or {}).get("seeds", []))
    rows = [[r["method"], r["task"], f"{r['value']:.2f} [{r['ci'][0]:.2f}, {r['ci'][1]:.2f}] ({r['n']})",
             f"{sum(held[r['method']]) / len(held[r['method']]):.3f}" if r["method"] in held else "1",
             seeds, art.status] for r in run.get("rows") or []]
    table = Table("Real model (SmolLM2-135M-Instruct, 30 layers) at 1,024 tokens: xKV — one SVD basis per group of "
                  "adjacent layers — against the full cache",
                  ["method", "task", "score [95%] (n)", "bytes / bf16 full cache", "seed", "file"], rows,
                  "xkv-gG@R: groups of G layers, factors (token coefficients and basis) at R of the group's bf16 "
                  "bytes; post-hoc sharing at keep 0.5 scored 0.00 on the same tasks (dev-seed pilot, "
                  "docs/results/smollm2_depth_posthoc_pilot.json); xKV's group and ratio were chosen on a dev seed "
                  "(docs/results/smollm2_depth_xkv_pilot.json)")
    head = [artifact_row(art, WHERE, d["label"], f"{d['value']:+.3f} [{d['ci'][0]:+.3f}, {d['ci'][1]:+.3f}]",
                         **headline_fields(d))
            for d in run.get("decisions") or [] if d.get("value") is not None]
    floor = _floor(run, art)
    return [table], head + ([floor] if floor is not None else [])


def _floor(run: dict[str, Any], art: Any) -> HeadlineRow | None:
    """No task the reference (the full cache) scores >= 0.5 on falls below 0.9x it, each row on its own interval."""
    ref = str((run.get("pooled") or {}).get("reference") or "")
    rows = run.get("rows") or []
    full = {r["task"]: r["value"] for r in rows if r["method"] == ref}
    fell, open_ = [], []
    for r in rows:
        if r["method"] == ref or full.get(r["task"], 0.0) < FLOOR_AT:
            continue
        bar = FLOOR * full[r["task"]]
        if r["ci"][1] < bar:
            fell.append(f"{r['method']} {r['task']} {r['value']:.2f} vs full {full[r['task']]:.2f}")
        elif r["ci"][0] < bar:
            open_.append(f"{r['method']} {r['task']}")
    if not any(v >= FLOOR_AT for v in full.values()):
        return None
    status = "missed" if fell else "undecided" if open_ else "met"
    measured = "; ".join(fell) if fell else ("open: " + "; ".join(open_)) if open_ else "no class below 0.9x"
    return artifact_row(art, WHERE, f"no task the full cache scores >= {FLOOR_AT} on below {FLOOR}x it", measured,
                        status=status)


__all__ = ["build"]
