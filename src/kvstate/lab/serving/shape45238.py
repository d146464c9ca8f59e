"""Hybrid prefix caching on the workload of vLLM issue #45238: a long shared prefix, a request-unique suffix.

vLLM's hybrid prefix caching (``mamba_cache_mode="align"``) keeps, per request, the recurrent state at the last
block boundary before the prompt ends; when that boundary falls in the request-unique suffix, no later request
matches and every hit is lost (https://github.com/vllm-project/vllm/issues/45238: ~2,200-token prompts, 64
requests at concurrency 1 — shared 1,600 / unique 600 gets 52 / 64 hits, shared 1,500 / unique 700 gets 0 / 64,
Qwen3.5-4B). Sparse prefix caching (``docs/techniques.md#position``) with ``kvstate serve``'s grid checkpoints
keeps recurrent states every 256 tokens of a cold prefill and learns the divergence depth, so a later request
resumes at most one block before the shared prefix ends whatever the suffix's length.

Both shapes (tasks ``1600-600`` and ``1500-700``) run on ``models/ref-hybrid`` through the server's request
path in this process (:class:`~kvstate.serve.generation.Generator` at concurrency 1, one reply token, no HTTP),
``--streams`` streams of 64 requests each: a stream starts from an empty prefix cache, its 64 requests share one
fresh prefix and each has its own suffix. Methods: ``grid-off`` (the prefix cache without grid checkpoints) and
``server`` (``kvstate serve``'s defaults: 1 GiB, grid block 256). A request scores 1 when it restored >= 90% of
the shared prefix (a "hit"; the first request of a stream is cold and scores 0), so a method's score is the
issue's hit count over 64 per stream; restored tokens and TTFT are kept per request.

Run as a module::

    OMP_NUM_THREADS=1 python -m kvstate.lab.serving.shape45238 --seed 1077 --out models/ref-hybrid/shape45238.json

Ignored: concurrency above 1 (the issue's measurement is at 1), the attention-only baseline (every block matches).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from typing import Any

from kvstate.lab.serving import common

SHAPES = {"1600-600": (1600, 600), "1500-700": (1500, 700)}  # task -> (shared prefix, unique suffix) tokens
REQUESTS = 64  # per stream, the count
GRID_BLOCK = {"grid-off": 0, "server": None}  # method -> grid block (None: kvstate serve's default grid)
METHODS = tuple(GRID_BLOCK)
HIT_SHARE = 0.9  # a request hits when it restores at least this share of the shared prefix
TARGET_HITS = 60  # of 64 (issue 46)
MODEL = Path("models/ref-hybrid")


def plans(model_dir: Path, seed: int, streams: int) -> tuple[Any, dict[str, Any]]:
    """The whole run and one quality experiment per shape (items: every request of every stream), each with the
    target ``server >= 60 / 64 hits``; committed with this module, before the run that decides them."""
    from kvstate.lab.experiment import Experiment, Target

    common = dict(axis="position", methods=METHODS, seeds=(seed,), lengths=(max(map(sum, SHAPES.values())),),
                  n=REQUESTS * streams, reference="server", code=("lab/serving/shape45238.py", "serve", "prefix",
                                                                     "models"),
                  models=(str(model_dir),), settings={"streams": streams, "requests_per_stream": REQUESTS,
                                                     "shapes": SHAPES, "hit_share": HIT_SHARE, "concurrency": 1,
                                                     "reply_tokens": 1})
    whole = Experiment(name="serve-45238", tasks=tuple(SHAPES), **common)  # type: ignore[arg-type]
    per = {task: Experiment(name=f"serve-45238-{task}", tasks=(task,), targets=(
        Target(f"vLLM #45238 shape {task} (shared / unique tokens), c = 1: >= {TARGET_HITS} / {REQUESTS} requests "
               f"restore >= {100 * HIT_SHARE:.0f}% of the shared prefix (kvstate serve's defaults)", "server",
               "score", TARGET_HITS / REQUESTS),), **common)  # type: ignore[arg-type]
           for task in SHAPES}
    return whole, per


def _log(msg: str) -> None:
    print(f"[serve-45238 {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def measure_all(model_dir: Path, seed: int, streams: int, whole: Any, per: dict[str, Any]) -> dict[str, Any]:
    """Every (method, shape) cell: ``streams`` streams of 64 requests; one result document for both shapes."""
    from dataclasses import asdict

    from kvstate.lab.experiment import Measurement, recorder, run
    from kvstate.prefix import PrefixCacheConfig
    from kvstate.prefix.engine import SparsePrefixCache
    from kvstate.prefix.grid import GridConfig
    from kvstate.serve.config import ServeConfig
    from kvstate.serve.generation import GenerationRequest, Generator
    from kvstate.serve.sampling import SamplingParams

    rec = recorder(whole)
    m = common.load(model_dir)
    model, tokenizer, ids, bos = m.model, m.tokenizer, m.ids, m.bos
    defaults = ServeConfig(model_id=model_dir.name)
    greedy = SamplingParams(temperature=0.0, ignore_eos=True)

    def measure(cell: Any) -> Any:
        shared, unique = SHAPES[cell.task]
        values: list[float] = []
        extra: dict[str, Any] = {"restored": [], "ttft_s": []}
        for s in range(streams):
            rng = random.Random(f"{seed}/{cell.task}/{s}")  # both methods see the same prompts
            prefix = bos + tuple(rng.choice(ids) for _ in range(shared - len(bos)))
            block = GRID_BLOCK[cell.method]
            grid = defaults.grid if block is None else GridConfig(block=block)
            gen = Generator(model, tokenizer, SparsePrefixCache(model, PrefixCacheConfig(defaults.budget_bytes),
                                                                grid=grid))
            for _ in range(REQUESTS):
                prompt = prefix + tuple(rng.choice(ids) for _ in range(unique))
                t0 = time.perf_counter()
                g = gen.run(GenerationRequest(prompt, max_tokens=1, sampling=greedy), lambda _: None, lambda: False)
                extra["ttft_s"].append(time.perf_counter() - t0)
                extra["restored"].append(g.reused_tokens)
                values.append(float(min(g.reused_tokens, shared) >= HIT_SHARE * shared))
            _log(f"{cell.task} {cell.method} stream {s + 1}/{streams}: {int(sum(values[-REQUESTS:]))} / {REQUESTS} "
                 f"hits, restored median {sorted(extra['restored'][-REQUESTS:])[REQUESTS // 2]}")
        return Measurement(values, extra)

    docs = {task: run(e, measure, out=None, progress=True) for task, e in per.items()}
    doc = {"experiment": {**asdict(whole), "settings": dict(whole.settings)},
           "rows": [r for d in docs.values() for r in d["rows"]],
           "pooled": {task: d["pooled"] for task, d in docs.items()},
           "decisions": [x for d in docs.values() for x in d["decisions"]]}
    return {"doc": doc, "provenance": rec.finish()}


def main(argv: list[str] | None = None) -> int:
    """Run both shapes (``--out`` appends the run with its provenance); 2 on bad input."""
    from kvstate.errors import KVStateError
    from kvstate.lab.experiment import check_out

    ap = argparse.ArgumentParser(prog="python -m kvstate.lab.serving.shape45238", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=MODEL)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--streams", type=int, default=5, help="streams of 64 requests per shape and method")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--overwrite", action="store_true")
    args = ap.parse_args(argv)
    if common.missing_model(args.model):
        return 2
    try:
        whole, per = plans(args.model, args.seed, args.streams)
        check_out(whole, args.out, overwrite=args.overwrite)
        result = measure_all(args.model, args.seed, args.streams, whole, per)
    except (KVStateError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return common.finish(args.out, result, args.overwrite)


if __name__ == "__main__":
    sys.exit(main())
