"""Benchmark: replay the four workloads through SparsePrefixCache on models/ref-hybrid (CPU, one thread).

For each workload trace (seeded, lengths scaled to keep the run short) and each planner: tokens reused
by the engine vs the offline evaluation's prediction for the same trace, KV bytes held vs the KV of the
distinct tokens in the tree, and R² of per-request wall-clock saved against tokens reused. Also the
12-request example: three 1,024-token documents, four questions each, shuffled — where every
document's third question resumes.

With ``--out FILE`` (the report reads ``models/ref-hybrid/prefix_replay.json``) the run is appended to FILE
with its provenance (:mod:`kvstate.lab.provenance`); prints a table on stderr, then one JSON line on stdout.
Timings are medians of ``--repeats`` (default 5) interleaved repeats with and without the cache, with the
spread of the per-repeat speed-up; ``--declare`` makes every request declare where it parts from the
others (:func:`kvstate.lab.prefix.replay.declared_boundaries`).
Usage: ``python benchmarks/prefix_replay.py [--requests 200] [--scale 0.125] [--repeats 5] [--declare]
[--planners optimal balanced] [--workloads chat quality] [--no-example] [--out FILE]``.

``--placement path tree [--workloads quality system_prompts] [--grid B:M,...] [--no-baseline]`` compares
tree placement (exact DP over the radix tree) with per-path placement at the same byte budget instead
(planner ``optimal``; one run per budget B and slot count M of the grid; the JSON line lists one row per
workload and placement; ``--out models/ref-hybrid/prefix_tree_replay.json`` appends it).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch

from kvstate.lab.prefix.replay import replay
from kvstate.lab.provenance import Recorder, append_run
from kvstate.lab.workloads.traces import generate
from kvstate.models import load_model
from kvstate.prefix.config import PrefixCacheConfig
from kvstate.prefix.engine import SparsePrefixCache

MODEL = Path("models/ref-hybrid")
BUDGET = 1 << 30
PLANNERS = ("optimal", "balanced")


def twelve_requests(vocab: int, seed: int = 0) -> tuple[list[tuple[int, ...]], list[int]]:
    """Three 1,024-token documents, four short questions each, shuffled; returns prompts and document ids."""
    rng = random.Random(seed)
    docs = [tuple(rng.randrange(3, vocab) for _ in range(1024)) for _ in range(3)]
    reqs = [
        (d, docs[d] + tuple(rng.randrange(3, vocab) for _ in range(12))) for d in range(3) for _ in range(4)
    ]
    rng.shuffle(reqs)
    return [r for _, r in reqs], [d for d, _ in reqs]


def run_twelve(model, vocab: int) -> dict[str, object]:  # type: ignore[no-untyped-def]
    prompts, doc_ids = twelve_requests(vocab)
    cache = SparsePrefixCache(model, PrefixCacheConfig(BUDGET, slots_per_entry=8))
    seen: dict[int, int] = {}
    third: dict[int, int] = {}
    reused = []
    for p, d in zip(prompts, doc_ids, strict=True):
        res = cache.prefill(torch.tensor([p]))
        reused.append(res.reused_tokens)
        seen[d] = seen.get(d, 0) + 1
        if seen[d] == 3:
            third[d] = res.reused_tokens
    m = cache.metrics
    return {
        "reused_per_request": reused,
        "third_question_reused": [third[d] for d in sorted(third)],
        "tokens_reused": m.tokens_reused,
        "tokens_total": m.tokens_total,
    }


def compare_placement(model, vocab: int, args: argparse.Namespace) -> None:  # type: ignore[no-untyped-def]
    """Tokens reused by tree vs per-path placement at the same byte budget, same trace, planner optimal."""
    print(
        f"{'workload':>15} {'placement':>9} {'budget':>12} {'M':>3} {'reqs':>5} {'total':>8} {'reused':>8} "
        f"{'lost':>7} {'peak MB':>8} {'ev.nodes':>8} {'ev.states':>9} {'wall s':>7}",
        file=sys.stderr,
    )
    runs = []
    for budget, slots in args.grid:
        rows = []
        for name in args.workloads:
            n = max(20, args.requests // 4) if name == "narrativeqa" else args.requests
            scale = args.scale / 2 if name == "narrativeqa" else args.scale
            reqs = generate(name, n, seed=args.seed, vocab=vocab, scale=scale)
            for placement in args.placement:
                cfg = PrefixCacheConfig(budget, slots, "optimal", placement=placement)
                r = replay(model, reqs, cfg, no_cache_baseline=not args.no_baseline)
                rows.append({"workload": name, **r.as_json()})
                print(
                    f"{name:>15} {placement:>9} {budget:>12} {slots:>3} {r.requests:>5} {r.tokens_total:>8} "
                    f"{r.tokens_reused:>8} {r.tokens_lost:>7} {r.peak_bytes / 2**20:>8.1f} {r.evicted_nodes:>8} "
                    f"{r.evicted_states:>9} {r.wall_s:>7.1f}",
                    flush=True,
                    file=sys.stderr,
                )
        runs.append({"budget_bytes": budget, "slots": slots, "results": rows})
    return runs


def _grid(value: str) -> list[tuple[int, int]]:
    try:
        pairs = [tuple(int(x) for x in item.split(":")) for item in value.split(",") if item.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--grid {value!r}: pass budget:slots pairs, e.g. 1073741824:8") from None
    if not pairs or any(len(p) != 2 or p[0] < 1 or p[1] < 1 for p in pairs):
        raise argparse.ArgumentTypeError(f"--grid {value!r}: pass budget:slots pairs, e.g. 1073741824:8")
    return [(p[0], p[1]) for p in pairs]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--scale", type=float, default=0.125)
    ap.add_argument("--out", type=Path, default=None, help="append this run, with provenance, to a result file")
    ap.add_argument("--placement", nargs="+", choices=["path", "tree"], default=None)
    ap.add_argument("--workloads", nargs="+", default=["quality", "narrativeqa", "system_prompts", "chat"])
    ap.add_argument("--grid", type=_grid, default=[(BUDGET, 8)], help="budget:slots pairs, comma-separated")
    ap.add_argument("--no-baseline", action="store_true", help="skip the no-cache prefills (faster)")
    ap.add_argument("--seed", type=int, default=0, help="trace seed: < 1000 for tuning; a result under models/ takes "
                    "a fresh test seed (>= 1000, see models/seeds_used.json)")
    ap.add_argument("--repeats", type=int, default=5, help="interleaved timing repeats with and without the cache")
    ap.add_argument("--declare", action="store_true", help="requests declare where they part (document ends)")
    ap.add_argument("--no-example", action="store_true", help="skip the 12-request example")
    ap.add_argument("--planners", nargs="+", default=list(PLANNERS), choices=["optimal", "balanced", "block", "log",
                                                                             "sqrt", "junction"])
    args = ap.parse_args()
    torch.set_num_threads(1)
    rec = Recorder(code=("prefix", "models", "lab/prefix/replay.py", "lab/workloads/traces.py"), models=[MODEL],
                   n=args.requests, seeds=[args.seed], tasks=args.workloads,
                   settings={"scale": args.scale, "placement": args.placement, "grid": args.grid})
    model = load_model(MODEL)
    vocab = int(model.get_output_embeddings().weight.shape[0])
    if args.placement:
        out = {"benchmark": "prefix_replay_placement", "model": str(MODEL), "scale": args.scale,
               "runs": compare_placement(model, vocab, args)}
        if args.out is not None:
            append_run(args.out, out, rec.finish())
        print(json.dumps(out))
        return
    workloads = {
        "quality": generate("quality", args.requests, seed=args.seed, vocab=vocab, scale=args.scale),
        "narrativeqa": generate(
            "narrativeqa", max(20, args.requests // 4), seed=args.seed, vocab=vocab, scale=args.scale / 2
        ),
        "system_prompts": generate("system_prompts", args.requests, seed=args.seed, vocab=vocab, scale=args.scale),
        "chat": generate("chat", args.requests, seed=args.seed, vocab=vocab, scale=args.scale),
    }
    workloads = {k: v for k, v in workloads.items() if k in args.workloads}
    rows = []
    print(
        f"{'workload':>15} {'planner':>9} {'reqs':>5} {'reused':>8} {'predicted':>9} {'ratio':>6} "
        f"{'KV held/distinct':>16} {'wall s':>7} {'no-cache s':>10} {'R2':>6} {'speed-up (spread)':>18}"
   , file=sys.stderr
    )
    for name, reqs in workloads.items():
        for planner in args.planners:
            r = replay(model, reqs, PrefixCacheConfig(BUDGET, 8, planner), repeats=args.repeats,
                       declare=args.declare, no_cache_baseline=not args.no_baseline)
            row = {"workload": name, **r.as_json()}
            rows.append(row)
            ratio = r.tokens_reused / r.predicted_reused if r.predicted_reused else float("nan")
            kv_ratio = r.kv_bytes_held / r.kv_bytes_distinct if r.kv_bytes_distinct else float("nan")
            print(
                f"{name:>15} {planner:>9} {r.requests:>5} {r.tokens_reused:>8} {r.predicted_reused:>9} "
                f"{ratio:>6.3f} {kv_ratio:>16.3f} {r.wall_s:>7.1f} {r.wall_s_no_cache:>10.1f} {r.saved_r2:>6.3f} "
                f"{r.wall_ratio:>6.2f} ({r.wall_ratio_min:.2f}-{r.wall_ratio_max:.2f})",
                flush=True,
                file=sys.stderr,
            )
    twelve = None if args.no_example else run_twelve(model, vocab)
    if twelve is not None:
        print(
            f"12-request example: third question of each document reused {twelve['third_question_reused']} "
            "tokens",
            file=sys.stderr,
        )
    out = {
        "benchmark": "prefix_replay",
        "model": str(MODEL),
        "budget_bytes": BUDGET,
        "scale": args.scale,
        "repeats": args.repeats,
        "declared": args.declare,
        "results": rows,
        "twelve": twelve,
    }
    if args.out is not None:
        append_run(args.out, out, rec.finish())
    print(json.dumps(out))


if __name__ == "__main__":
    main()
