"""The prefix replay benchmark the report reads: the four workloads through the engine on ``models/ref-hybrid``.

Sparse prefix caching ("Sparse Prefix Caching for Hybrid and Recurrent LLM Serving") served online: for each
seeded workload trace and planner, tokens reused by the engine vs the offline prediction, KV bytes held vs the
distinct tokens' KV, R² of per-request time saved against tokens reused, and the no-cache / cache wall-time
ratio over interleaved repeats (median and spread); the 12-request example (three 1,024-token documents,
four questions each, shuffled). With ``placement`` it compares tree and per-path placement at the same byte
budgets instead. ``kvstate prefix replay-bench`` runs it (moved here from ``benchmarks/``: a result the report
reads has one door, the lab); a result under ``models/`` passes the seed ledger before any work
(:func:`kvstate.lab.experiment.preflight`) and is appended with provenance.
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstate.lab.workloads.traces import WORKLOADS

MODEL = Path("models/ref-hybrid")
BUDGET = 1 << 30
CODE = ("prefix", "models", "lab/prefix/replay.py", "lab/prefix/bench.py", "lab/workloads/traces.py")


@dataclass(frozen=True)
class ReplayBench:
    """One replay benchmark run (frozen: what the run was configured with)."""

    requests: int = 200
    scale: float = 0.125
    seed: int = 0  # trace seed: < 1000 for tuning; a result under models/ takes a fresh test seed
    repeats: int = 5  # interleaved timing repeats with and without the cache
    declare: bool = False  # requests declare where they part (document ends)
    example: bool = True  # the 12-request example
    planners: tuple[str, ...] = ("optimal", "balanced")
    workloads: tuple[str, ...] = WORKLOADS
    placement: tuple[str, ...] = ()  # ("path", "tree"): compare placements instead (planner: the first)
    grid: tuple[tuple[int, int], ...] = ((BUDGET, 8),)  # (budget bytes, slots) per placement run
    baseline: bool = True  # time the no-cache prefills
    model: Path = field(default=MODEL)

    def settings(self) -> dict[str, Any]:
        return {"scale": self.scale, "placement": list(self.placement) or None, "grid": [list(g) for g in self.grid],
                "planners": list(self.planners), "repeats": self.repeats, "declare": self.declare,
                "baseline": self.baseline}


def _trace(name: str, a: ReplayBench, vocab: int) -> Any:
    from kvstate.lab.workloads.traces import generate

    # narrativeqa's documents are long: fewer requests at half the scale keep its run as short as the others'
    n = max(20, a.requests // 4) if name == WORKLOADS[1] else a.requests
    scale = a.scale / 2 if name == WORKLOADS[1] else a.scale
    return generate(name, n, seed=a.seed, vocab=vocab, scale=scale)


def twelve_requests(vocab: int, seed: int = 0) -> tuple[list[tuple[int, ...]], list[int]]:
    """Three 1,024-token documents, four short questions each, shuffled; returns prompts and document ids."""
    rng = random.Random(seed)
    docs = [tuple(rng.randrange(3, vocab) for _ in range(1024)) for _ in range(3)]
    reqs = [
        (d, docs[d] + tuple(rng.randrange(3, vocab) for _ in range(12))) for d in range(3) for _ in range(4)
    ]
    rng.shuffle(reqs)
    return [r for _, r in reqs], [d for d, _ in reqs]


def run_twelve(model: Any, vocab: int) -> dict[str, object]:
    import torch

    from kvstate.prefix.config import PrefixCacheConfig
    from kvstate.prefix.engine import SparsePrefixCache

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


def compare_placement(model: Any, vocab: int, a: ReplayBench) -> list[dict[str, Any]]:
    """Tokens reused by tree vs per-path placement at the same byte budget, same trace, the first planner."""
    from kvstate.lab.prefix.replay import replay
    from kvstate.prefix.config import PrefixCacheConfig

    print(
        f"{'workload':>15} {'placement':>9} {'budget':>12} {'M':>3} {'reqs':>5} {'total':>8} {'reused':>8} "
        f"{'lost':>7} {'peak MB':>8} {'ev.nodes':>8} {'ev.states':>9} {'wall s':>7}",
        file=sys.stderr,
    )
    runs = []
    for budget, slots in a.grid:
        rows = []
        for name in a.workloads:
            reqs = _trace(name, a, vocab)
            for placement in a.placement:
                cfg = PrefixCacheConfig(budget, slots, a.planners[0], placement=placement)
                r = replay(model, reqs, cfg, no_cache_baseline=a.baseline)
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


def run_workloads(model: Any, vocab: int, a: ReplayBench) -> list[dict[str, Any]]:
    """Every workload x planner through the engine, with interleaved no-cache timing repeats."""
    from kvstate.lab.prefix.replay import replay
    from kvstate.prefix.config import PrefixCacheConfig

    rows = []
    print(f"{'workload':>15} {'planner':>9} {'reqs':>5} {'reused':>8} {'predicted':>9} {'ratio':>6} "
          f"{'KV held/distinct':>16} {'wall s':>7} {'no-cache s':>10} {'R2':>6} {'speed-up (spread)':>18}",
          file=sys.stderr)
    for name in a.workloads:
        reqs = _trace(name, a, vocab)
        for planner in a.planners:
            r = replay(model, reqs, PrefixCacheConfig(BUDGET, 8, planner), repeats=a.repeats, declare=a.declare,
                       no_cache_baseline=a.baseline)
            rows.append({"workload": name, **r.as_json()})
            ratio = r.tokens_reused / r.predicted_reused if r.predicted_reused else float("nan")
            kv_ratio = r.kv_bytes_held / r.kv_bytes_distinct if r.kv_bytes_distinct else float("nan")
            print(f"{name:>15} {planner:>9} {r.requests:>5} {r.tokens_reused:>8} {r.predicted_reused:>9} "
                  f"{ratio:>6.3f} {kv_ratio:>16.3f} {r.wall_s:>7.1f} {r.wall_s_no_cache:>10.1f} {r.saved_r2:>6.3f} "
                  f"{r.wall_ratio:>6.2f} ({r.wall_ratio_min:.2f}-{r.wall_ratio_max:.2f})", flush=True, file=sys.stderr)
    return rows


def run_bench(a: ReplayBench, out: Path | None = None, *, overwrite: bool = False,
              command: str | None = None) -> dict[str, Any]:
    """Run the benchmark; append it with provenance to ``out`` (the ledger checked before any work)."""
    import torch

    from kvstate.lab.cli_output import check_results_out, write_results
    from kvstate.lab.experiment import preflight
    from kvstate.lab.provenance import Recorder
    from kvstate.models import load_model

    rec = Recorder(code=CODE, models=[a.model], n=a.requests, seeds=[a.seed], tasks=list(a.workloads),
                   command=command, settings=a.settings())
    if out is not None:
        check_results_out(out, overwrite=overwrite)
        preflight(out, rec.finish())
    torch.set_num_threads(1)
    model = load_model(a.model)
    vocab = int(model.get_output_embeddings().weight.shape[0])
    result: dict[str, Any]
    if a.placement:
        result = {"benchmark": "prefix_replay_placement", "model": str(a.model), "scale": a.scale,
                  "runs": compare_placement(model, vocab, a)}
    else:
        rows = run_workloads(model, vocab, a)
        twelve = run_twelve(model, vocab) if a.example else None
        result = {"benchmark": "prefix_replay", "model": str(a.model), "budget_bytes": BUDGET, "scale": a.scale,
                  "repeats": a.repeats, "declared": a.declare, "results": rows, "twelve": twelve}
    prov = rec.finish()
    if out is not None:
        write_results(out, result, prov, overwrite=overwrite)
    return {**result, "provenance": prov}
