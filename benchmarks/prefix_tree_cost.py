"""Benchmark: tree vs path placement on the replay traces, store only — tokens reused at equal bytes, and the
store's bookkeeping per request (``begin`` + ``commit``: matching, planning or re-planning, inserting,
evicting), amortised over the trace.

The store is driven exactly as :class:`kvstate.prefix.engine.SparsePrefixCache` drives it in the replay
(``full_state=True``, its planner, ``capture_min_saving = align / 2``), with the byte sizes of
``models/ref-hybrid`` (one recurrent checkpoint, attention KV per token and one logits row, fp32, from its
config) charged for payloads that are placeholders: no model runs, so the timings are the store's alone.
The traces are the replay's (``generate(workload, ...)``, seed 0, vocabulary and scale as the replay).
Prints a table on stderr and one JSON line on stdout.
Usage: ``python benchmarks/prefix_tree_cost.py [--requests 200] [--scale 0.125] [--grid B:M,...]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoConfig

from kvstate.lab.workloads.traces import generate
from kvstate.models import checkpoint_bytes, chunk_size, kv_bytes_per_token
from kvstate.prefix.placement import plan_checkpoints
from kvstate.prefix.store import PrefixStore, StoreConfig

MODEL = Path("models/ref-hybrid")
GRID = ((1 << 30, 8), (32 << 20, 8), (1 << 30, 2), (16 << 20, 2))


def store_for(config, budget: int, slots: int, placement: str) -> PrefixStore:  # type: ignore[no-untyped-def]
    align = int(chunk_size(config) or 1)

    def plan(w: np.ndarray, n: int) -> list[int]:  # the engine's planner
        return [] if n <= align else plan_checkpoints(w, slots, "optimal", align, block_size=64)

    cfg = StoreConfig(
        budget, slots, checkpoint_bytes(config, torch.float32), kv_bytes_per_token(config, torch.float32),
        int(config.vocab_size) * 4, placement=placement, align=align, capture_min_saving=align / 2,
    )
    return PrefixStore(cfg, plan, splitter=lambda kv, k: (kv, kv))


def run(config, tokens: list[tuple[int, ...]], budget: int, slots: int, placement: str) -> dict[str, float]:  # type: ignore[no-untyped-def]
    store = store_for(config, budget, slots, placement)
    times, reused = [], 0
    for toks in tokens:
        t0 = time.perf_counter()
        txn = store.begin(toks, full_state=True)
        if txn.hit.full:
            store.commit(txn, {}, None)
        else:
            store.commit(txn, dict.fromkeys(txn.capture, "state"), lambda a, b: "kv", "logits")
        times.append(time.perf_counter() - t0)
        reused += txn.hit.position
    m = store.metrics()
    return {"reused": reused, "ms_mean": 1e3 * statistics.fmean(times), "ms_median": 1e3 * statistics.median(times),
            "ms_max": 1e3 * max(times), "peak_mib": m.peak_bytes / 2**20, "evicted_states": m.evicted_states}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--scale", type=float, default=0.125)
    ap.add_argument("--workloads", nargs="+", default=["quality", "narrativeqa", "system_prompts", "chat"])
    args = ap.parse_args()
    config = AutoConfig.from_pretrained(MODEL, local_files_only=True)
    vocab = int(config.vocab_size)
    rows = []
    print(f"{'workload':>15} {'budget':>11} {'M':>2} {'tokens':>8} {'path reused':>11} {'tree reused':>11} "
          f"{'path ms/req':>11} {'tree ms/req':>11} {'tree max ms':>11}", file=sys.stderr)
    for name in args.workloads:
        n = max(20, args.requests // 4) if name == "narrativeqa" else args.requests
        scale = args.scale / 2 if name == "narrativeqa" else args.scale
        tokens = [r.tokens for r in generate(name, n, seed=0, vocab=vocab, scale=scale)]
        total = sum(len(t) for t in tokens)  # type: ignore[arg-type]
        for budget, slots in GRID:
            path = run(config, tokens, budget, slots, "path")
            tree = run(config, tokens, budget, slots, "tree")
            rows.append({"workload": name, "budget_bytes": budget, "slots": slots, "requests": n,
                         "tokens_total": total, "path": path, "tree": tree})
            print(f"{name:>15} {budget:>11} {slots:>2} {total:>8} {path['reused']:>11} {tree['reused']:>11} "
                  f"{path['ms_mean']:>11.2f} {tree['ms_mean']:>11.2f} {tree['ms_max']:>11.1f}",
                  file=sys.stderr, flush=True)
    never_worse = all(r["tree"]["reused"] >= r["path"]["reused"] for r in rows)
    worst_ms = max(r["tree"]["ms_mean"] for r in rows)
    print(f"tree never worse than path: {never_worse}; worst amortised tree bookkeeping {worst_ms:.2f} ms/request",
          file=sys.stderr)
    print(json.dumps({"benchmark": "prefix_tree_cost", "model": str(MODEL), "scale": args.scale,
                      "tree_never_worse": never_worse, "tree_ms_per_request_max": worst_ms, "rows": rows}))


if __name__ == "__main__":
    main()
