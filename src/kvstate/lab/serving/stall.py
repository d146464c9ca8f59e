"""Decode beside prefill: the server's scheduler at concurrency 1 and 8, its prefill chunk while others decode.

Continuous batching with chunked prefill ("Taming Throughput-Latency Tradeoff in LLM Inference with
Sarathi-Serve", Agrawal et al., OSDI 2024; ``docs/techniques.md#serving-kvstate-serve``): a prefill that
runs beside decoding requests stalls each of their next tokens by one chunk's compute; a smaller chunk
(``--max-prefill-while-decoding``) keeps inter-token latency down and costs the newcomer's first token.
This benchmark runs ``kvstate serve``'s scheduler in this process (the same :class:`Scheduler`,
:class:`Generator` and prefix cache as :func:`kvstate.serve.app.create_app` builds, at the server's
defaults: 1 GiB budget, grid checkpoints; no HTTP) under a closed-loop client: ``c`` streams, each sending
its next request when its reply ends, greedy replies of ``--output-tokens`` tokens (end of sequence
ignored), one model thread.

Methods are an arm at a concurrency, ``ARM@cC``: ``chunk512`` (the default: every prefill in calls of 512
tokens), ``stall256``, ``stall128`` and ``stall64`` (``max_prefill_while_decoding`` 256 / 128 / 64). Tasks are two workloads:
``shared-prefix`` (4 prefixes of ``--prefix-tokens`` in turn, each request a fresh ``--suffix-tokens``
tail; each repeat starts from an empty prefix cache, so a prefix's first visit is cold) and
``no-shared-prefix`` (every prompt fresh, the same length). A cell is one closed-loop run of ``--requests-c1``
/ ``--requests-c8`` requests; methods rotate between repeats (interleaved). Three timing experiments read the
same runs: ``itl`` (median gap between a stream's consecutive tokens), ``ttft`` (p99 of time to first token at
c = 8, its median at c = 1: the issue's "p99 at c = 8 against c = 1's median") and ``per-token`` (seconds per
output token: 1 / output tokens/s); each run also records goodput (the share of requests with TTFT <= 500 ms
and mean inter-token latency <= 50 ms) and, on ``shared-prefix``, the prompt tokens each later visit of a
prefix restored.

Run as a module::

    OMP_NUM_THREADS=1 python -m kvstate.lab.serving.stall --seed 1072 --out models/ref-hybrid/stall.json

Ignored: HTTP and tokenization (the client is in-process; ``benchmarks/serve_clients.py`` and
``kvstate.lab.models.serve_peer`` measure the server over HTTP), sampling, concurrency 16.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvstate.lab.serving import common

ARMS = {"chunk512": None, "stall256": 256, "stall128": 128, "stall64": 64}  # arm -> max_prefill_while_decoding
# the test run's arms: the server's default (the dev-seed pilot's choice: docs/results/serve_stall_pilot.json) and the
# smallest chunk piloted (its best inter-token latency, its worst first token)
DEFAULT_ARMS = ("chunk512", "stall64")
CONCURRENCY = (1, 8)
TASKS = ("shared-prefix", "no-shared-prefix")
PREFIXES = 4
TTFT_SLO_S, ITL_SLO_S = 0.5, 0.05  # goodput objectives on the hybrid (issue 46)
MODEL = Path("models/ref-hybrid")


def method(arm: str, c: int) -> str:
    return f"{arm}@c{c}"


def split_method(name: str) -> tuple[str, int]:
    arm, _, c = name.rpartition("@c")
    return arm, int(c)


@dataclass(frozen=True)
class Load:
    """One closed-loop run's shape (a frozen configuration)."""

    prefix_tokens: int = 1024
    suffix_tokens: int = 64
    output_tokens: int = 32
    requests_c1: int = 8
    requests_c8: int = 24

    def requests(self, c: int) -> int:
        return self.requests_c1 if c == 1 else self.requests_c8


def prompts(ids: Sequence[int], bos: tuple[int, ...], task: str, n: int, load: Load,
            rng: random.Random) -> list[tuple[int, ...]]:
    """``n`` prompts of ``prefix + suffix`` tokens: on ``shared-prefix`` request ``i`` uses prefix ``i % 4``."""
    def fresh(k: int) -> tuple[int, ...]:
        return tuple(rng.choice(ids) for _ in range(k))

    heads = [bos + fresh(load.prefix_tokens - len(bos)) for _ in range(PREFIXES)]
    out = []
    for i in range(n):
        head = heads[i % PREFIXES] if task == "shared-prefix" else bos + fresh(load.prefix_tokens - len(bos))
        out.append(head + fresh(load.suffix_tokens))
    return out


async def closed_loop(scheduler: Any, batch: Sequence[tuple[int, ...]], c: int, output_tokens: int
                      ) -> list[dict[str, Any]]:
    """Send ``batch`` through ``c`` streams, each its next request when its reply ends; per request its
    TTFT, token times and reused prompt tokens."""
    from kvstate.serve.generation import GenerationRequest
    from kvstate.serve.sampling import SamplingParams

    greedy = SamplingParams(temperature=0.0, ignore_eos=True)
    todo = list(enumerate(batch))
    done: list[dict[str, Any]] = [{} for _ in batch]

    async def stream() -> None:
        while todo:
            i, prompt = todo.pop(0)
            t0 = time.perf_counter()
            job = scheduler.submit(GenerationRequest(prompt, max_tokens=output_tokens, sampling=greedy))
            marks: list[tuple[float, int]] = []  # (time, reply tokens so far) at each delta
            while True:
                kind, payload = await job.events.get()
                if kind == "delta":
                    marks.append((time.perf_counter(), payload.completion_tokens))
                elif kind == "done":
                    g = payload
                    break
                else:
                    raise RuntimeError(f"request {i}: {kind}: {payload}")
            end = time.perf_counter()
            gaps = [(b - a) / max(1, kb - ka) for (a, ka), (b, kb) in itertools.pairwise(marks)]
            done[i] = {"start": t0, "end": end, "ttft": (marks[0][0] if marks else end) - t0, "gaps": gaps,
                       "tokens": g.completion_tokens, "reused": g.reused_tokens, "prompt": g.prompt_tokens}

    await asyncio.gather(*(stream() for _ in range(c)))
    return done


def summarize(reqs: Sequence[dict[str, Any]], task: str, load: Load) -> dict[str, Any]:
    """One run's figures: TTFT p50 / p99, ITL p50, output tokens/s, goodput, and later visits' restored share."""
    ttft = np.array([r["ttft"] for r in reqs])
    gaps = np.array([g for r in reqs for g in r["gaps"]])
    span = max(r["end"] for r in reqs) - min(r["start"] for r in reqs)
    good = [r["ttft"] <= TTFT_SLO_S and (not r["gaps"] or statistics.fmean(r["gaps"]) <= ITL_SLO_S) for r in reqs]
    out = {"requests": len(reqs), "ttft_p50_s": float(np.median(ttft)), "ttft_p99_s": float(np.percentile(ttft, 99)),
           "itl_p50_s": float(np.median(gaps)) if gaps.size else None,
           "itl_p99_s": float(np.percentile(gaps, 99)) if gaps.size else None,
           "output_tok_s": sum(r["tokens"] for r in reqs) / span, "goodput": sum(good) / len(good)}
    if task == "shared-prefix":  # visits after each prefix's first (requests are sent in order, 4 prefixes in turn)
        later = [r["reused"] / load.prefix_tokens for r in reqs[PREFIXES:]]
        out["later_visits"] = len(later)
        out["later_visits_restoring_90pct"] = sum(x >= 0.9 for x in later)
    return out


def plans(model_dir: Path, seed: int, repeats: int, load: Load, arms: Sequence[str] = DEFAULT_ARMS
          ) -> tuple[Any, dict[str, tuple[Any, Any, Any]]]:
    """The whole run (every task; its provenance and seed-ledger entry) and, per task, the three timing
    experiments over the same closed-loop runs (ITL, TTFT, per-token cost), each with one target per arm; the
    targets are committed with this module, before the runs that decide them."""
    from kvstate.lab.experiment import Experiment, Target

    methods = tuple(method(a, c) for c in CONCURRENCY for a in arms)
    settings = {"load": load.__dict__, "arms": {a: {"max_prefill_while_decoding": ARMS[a], "max_tokens_per_step": 512}
                                               for a in arms},
                "client": "closed loop, in-process (no HTTP)", "threads": 1, "dtype": "float32",
                "goodput": {"ttft_s": TTFT_SLO_S, "itl_s": ITL_SLO_S}}
    out = {}
    whole = Experiment(name="serve-stall", axis="position", methods=methods, seeds=(seed,), tasks=TASKS,
                       lengths=(load.prefix_tokens,), repeats=repeats, kind="timing",
                       code=("lab/serving/stall.py", "serve", "prefix", "models"), models=(str(model_dir),),
                       settings=settings)
    for task in TASKS:
        common = dict(axis="position", methods=methods, seeds=(seed,), tasks=(task,), lengths=(load.prefix_tokens,),
                      repeats=repeats, kind="timing", code=("lab/serving/stall.py", "serve", "prefix", "models"),
                      models=(str(model_dir),), settings=settings)

        def per_arm(label: str, ratio: float, task: str = task) -> tuple[Any, ...]:
            return tuple(Target(f"{a}, {task}: " + label, method(a, 8), "ratio", ratio, higher_is_better=False,
                                against=method(a, 1)) for a in arms)

        out[task] = (
            Experiment(name=f"serve-stall-itl-{task}", targets=per_arm(
                "ITL p50 at c = 8 <= 2.5x c = 1's (ref-hybrid, in-process)", 2.5), **common),  # type: ignore[arg-type]
            Experiment(name=f"serve-stall-ttft-{task}", targets=per_arm(
                "TTFT p99 at c = 8 <= 4x c = 1's median (ref-hybrid, in-process)", 4.0), **common),  # type: ignore[arg-type]
            Experiment(name=f"serve-stall-per-token-{task}", targets=per_arm(
                "output tokens/s at c = 8 >= 3x c = 1 (seconds per output token <= 1/3)", 1 / 3),
                **common))  # type: ignore[arg-type]
    return whole, out


def _log(msg: str) -> None:
    print(f"[serve-stall {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (``--out`` appends the run with its provenance); 2 on bad input."""
    from kvstate.errors import KVStateError
    from kvstate.lab.experiment import check_out

    ap = argparse.ArgumentParser(prog="python -m kvstate.lab.serving.stall", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=MODEL)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--requests-c1", type=int, default=Load.requests_c1)
    ap.add_argument("--requests-c8", type=int, default=Load.requests_c8)
    ap.add_argument("--prefix-tokens", type=int, default=Load.prefix_tokens)
    ap.add_argument("--suffix-tokens", type=int, default=Load.suffix_tokens)
    ap.add_argument("--output-tokens", type=int, default=Load.output_tokens)
    ap.add_argument("--arms", nargs="+", choices=sorted(ARMS), default=list(DEFAULT_ARMS))
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--overwrite", action="store_true")
    args = ap.parse_args(argv)
    if common.missing_model(args.model):
        return 2
    load = Load(args.prefix_tokens, args.suffix_tokens, args.output_tokens, args.requests_c1, args.requests_c8)
    try:
        whole, plan = plans(args.model, args.seed, args.repeats, load, tuple(args.arms))
        check_out(whole, args.out, overwrite=args.overwrite)
        result = measure_all(args.model, args.seed, load, whole, plan)
    except (KVStateError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return common.finish(args.out, result, args.overwrite)


def measure_all(model_dir: Path, seed: int, load: Load, whole: Any, plan: dict[str, tuple[Any, Any, Any]]
                ) -> dict[str, Any]:
    """Per task, run every cell of the ITL experiment (the closed-loop runs), then decide the other two on the same
    runs; one document holding every experiment's rows and decisions."""
    from kvstate.lab.experiment import Measurement, recorder, run
    from kvstate.prefix import PrefixCacheConfig
    from kvstate.prefix.engine import SparsePrefixCache
    from kvstate.serve.config import ServeConfig
    from kvstate.serve.generation import Generator
    from kvstate.serve.policy import BatchPolicy
    from kvstate.serve.scheduler import Scheduler

    rec = recorder(whole)
    m = common.load(model_dir)
    model, tokenizer, ids, bos = m.model, m.tokenizer, m.ids, m.bos
    defaults = ServeConfig(model_id=model_dir.name)
    runs: dict[tuple[str, str, int], dict[str, Any]] = {}

    def measure(cell: Any) -> Any:  # one closed-loop run: a fresh (flushed) prefix cache and scheduler
        arm, c = split_method(cell.method)
        rng = random.Random(f"{seed}/{cell.task}/{cell.repeat}")  # every arm sees the same prompts in a repeat
        batch = prompts(ids, bos, cell.task, load.requests(c), load, rng)
        policy = BatchPolicy(defaults.policy.name, defaults.policy.max_batch, defaults.policy.max_tokens_per_step,
                             ARMS[arm])
        cache = SparsePrefixCache(model, PrefixCacheConfig(defaults.budget_bytes), grid=defaults.grid)  # flushed
        scheduler = Scheduler(defaults.max_queue, Generator(model, tokenizer, cache), policy)

        async def go() -> list[dict[str, Any]]:
            scheduler.start()
            try:
                return await closed_loop(scheduler, batch, c, load.output_tokens)
            finally:
                scheduler.stop()

        reqs = asyncio.run(go())
        row = summarize(reqs, cell.task, load)
        runs[(cell.method, cell.task, cell.repeat)] = row
        _log(f"repeat {cell.repeat + 1} {cell.task} {cell.method}: ITL p50 {1e3 * (row['itl_p50_s'] or 0):.1f} ms, "
             f"TTFT p50 {1e3 * row['ttft_p50_s']:.0f} / p99 {1e3 * row['ttft_p99_s']:.0f} ms, "
             f"{row['output_tok_s']:.1f} tok/s, goodput {row['goodput']:.2f}")
        return Measurement([row["itl_p50_s"]], {f"r{cell.repeat}": row})

    def ttft(cell: Any) -> Any:
        row = runs[(cell.method, cell.task, cell.repeat)]
        return Measurement([row["ttft_p99_s"] if split_method(cell.method)[1] > 1 else row["ttft_p50_s"]])

    def per_token(cell: Any) -> Any:
        return Measurement([1.0 / runs[(cell.method, cell.task, cell.repeat)]["output_tok_s"]])

    docs = {}
    for task, (itl_e, ttft_e, tok_e) in plan.items():
        itl_doc = run(itl_e, measure, out=None, progress=True)
        docs[task] = [itl_doc, run(ttft_e, ttft, out=None), run(tok_e, per_token, out=None)]
    from dataclasses import asdict

    doc: dict[str, Any] = {"experiment": {**asdict(whole), "settings": dict(whole.settings)},
                           "rows": [r for d in docs.values() for r in d[0]["rows"]], "pooled": None,
                           "decisions": [x for d in docs.values() for e in d for x in e["decisions"]],
                           "experiments": {d["experiment"]["name"]: {k: d[k] for k in ("experiment", "rows")}
                                           for ds in docs.values() for d in ds},
                           "goodput": goodput(runs), "later_visits": later_visits(runs)}
    return {"doc": doc, "provenance": rec.finish()}


def later_visits(runs: dict[tuple[str, str, int], dict[str, Any]]) -> list[dict[str, Any]]:
    """Per method on ``shared-prefix``: visits after each prefix's first restoring >= 90% of it, over every repeat
    (Wilson interval), decided against the issue's >= 95% of visits (a share of visits, beside the loop's
    timing decisions)."""
    from kvstate.lab import stats

    out = []
    for m in dict.fromkeys(m for m, t, _ in runs if t == "shared-prefix"):
        rows = [r for (mm, tt, _), r in runs.items() if (mm, tt) == (m, "shared-prefix")]
        hit, total = sum(r["later_visits_restoring_90pct"] for r in rows), sum(r["later_visits"] for r in rows)
        if total == 0:  # fewer requests than prefixes: no later visit
            continue
        est = stats.wilson(hit, total)
        out.append({"method": m, "restoring_90pct": hit, "visits": total, "share": est.value, "ci": [est.lo, est.hi],
                    "status": stats.decide(est.lo, est.hi, 0.95)})
    return out


def goodput(runs: dict[tuple[str, str, int], dict[str, Any]]) -> list[dict[str, Any]]:
    """Per method and task, the share of requests over every repeat that met both objectives (Wilson interval);
    shown beside the decisions (the issue's >= 90% at c = 8), not decided by the loop (a share of requests, not a
    per-repeat timing)."""
    from kvstate.lab import stats

    out = []
    for m, task in dict.fromkeys((m, t) for m, t, _ in runs):
        rows = [r for (mm, tt, _), r in runs.items() if (mm, tt) == (m, task)]
        met = sum(round(r["goodput"] * r["requests"]) for r in rows)
        total = sum(r["requests"] for r in rows)
        est = stats.wilson(met, total)
        out.append({"method": m, "task": task, "met": met, "requests": total, "share": est.value,
                    "ci": [est.lo, est.hi]})
    return out


if __name__ == "__main__":
    sys.exit(main())
