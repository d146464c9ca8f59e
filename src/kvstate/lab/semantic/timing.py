"""Decode time of a compressed cache against the full cache: ms per token, the question pass included.

For "SEKV: Resolution-Adaptive Semantic KV Cache with Hierarchical Semantic Memory"
(``docs/techniques.md#resolution``). Each item's context is prefilled once and compressed once per method
(:mod:`kvstate.lab.semantic.methods`); then, for each of ``--repeats`` rounds, every method answers every
item's question on a fresh fork of its cache — the question fed in one pass, then greedy single-token steps —
and the wall time of the whole answer over the tokens it fed and generated is that round's ms / token. Rounds
interleave the methods (the order alternates round by round), so drift in the machine's load falls on all
of them; a method's number is the median over rounds with the min and max, and its ratio to the reference is
taken per round (median and spread). Run on dev seeds for design::

    python -m kvstate.lab.semantic.timing --model models/ref-attn --router models/ref-attn-sekv \\
        --length 2048 --budget 0.125 --methods full,sekv --n 4 --repeats 5 --seed 2 --out docs/results/sekv_decode.json
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvstate.lab.decode import greedy_decode
from kvstate.lab.harness import load_reference
from kvstate.lab.provenance import Recorder, append_run
from kvstate.lab.semantic import methods
from kvstate.lab.semantic.bench import compressed_cache, prefill
from kvstate.lab.semantic.protocol import build_items
from kvstate.semantic import SegmentConfig, SemanticRouter

MIN_REPEATS = 5


@torch.no_grad()
def time_methods(model: Any, tokenizer: Any, items: list[Any], names: list[str], budget: float,
                 router: SemanticRouter | None, segment: SegmentConfig, repeats: int,
                 options: methods.SekvOptions | None = None, expand_share: float = 0.5) -> dict[str, Any]:
    """Per method: ms / token of each round (mean over items), the median and spread, and the ratio to the
    registry's reference per round."""
    caches = []
    for it in items:
        pre = prefill(model, it)
        caches.append({m: compressed_cache(m, model, tokenizer, it, budget, router, segment, prefilled=pre,
                                           options=options, expand_share=expand_share) for m in names})
    ctx = methods.Context(router, segment, expand_share,
                          options=options if options is not None else methods.SekvOptions())
    rounds: dict[str, list[float]] = {m: [] for m in names}
    for r in range(repeats):
        order = names if r % 2 == 0 else names[::-1]
        spent = {m: [0.0, 0] for m in names}
        for it, per in zip(items, caches, strict=True):
            for m in order:
                meth = methods.get(m)
                work = meth.fork(per[m], budget, ctx)
                q = it.questions[0]
                with meth.attention(model):
                    t0 = time.perf_counter()
                    res = greedy_decode(model, work, len(it.context), it.max_new_tokens[0], tokenizer.eos_token_id,
                                        input_ids=q)
                    dt = time.perf_counter() - t0
                spent[m][0] += dt
                spent[m][1] += len(q) + res.steps
        for m in names:
            rounds[m].append(1000 * spent[m][0] / max(spent[m][1], 1))
    ref = methods.reference()
    out: dict[str, Any] = {}
    for m in names:
        v = rounds[m]
        row: dict[str, Any] = {"ms_per_token_rounds": [round(x, 4) for x in v], "median": round(float(np.median(v)), 4),
                               "min": round(min(v), 4), "max": round(max(v), 4)}
        if ref in rounds and m != ref:
            ratio = [a / b for a, b in zip(v, rounds[ref], strict=True)]
            row["ratio_to_reference"] = {"median": round(float(np.median(ratio)), 4), "min": round(min(ratio), 4),
                                         "max": round(max(ratio), 4)}
        out[m] = row
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--model", default="models/ref-attn")
    ap.add_argument("--router", default="models/ref-attn-sekv", help="a router directory, or none (methods that "
                    "route by keys, e.g. on the real model)")
    ap.add_argument("--task", default="niah_single", help="the items' task (real_niah_single on the real model)")
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--budget", type=float, default=0.125)
    ap.add_argument("--methods", default="full,sekv")
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=MIN_REPEATS)
    ap.add_argument("--seed", type=int, default=2)
    ap.add_argument("--recent", type=int, default=16)
    ap.add_argument("--max-span", type=int, default=64)
    ap.add_argument("--memory", type=float, default=None)
    ap.add_argument("--slow", choices=("lowrank", "quant"), default="lowrank")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--expand-share", type=float, default=0.5)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    if a.repeats < MIN_REPEATS:
        raise SystemExit(f"--repeats {a.repeats}: a timing needs >= {MIN_REPEATS} interleaved repeats")
    names = methods.resolve(a.methods.split(",")).methods
    torch.set_num_threads(1)
    code = ("semantic", "models", "lab/semantic/timing.py", "lab/semantic/bench.py", "lab/semantic/protocol.py",
            "lab/semantic/methods", "lab/harness.py", "lab/decode.py")  # what it runs (not the report's section)
    no_router = a.router.lower() == "none"
    rec = Recorder(code=code, models=[a.model] if no_router else [a.model, a.router], n=a.n, seeds=[a.seed],
                   tasks=[a.task], lengths=[a.length],
                   settings={"budget": a.budget, "methods": names, "repeats": a.repeats, "recent": a.recent,
                             "max_span": a.max_span, "memory": a.memory, "slow": a.slow, "bits": a.bits,
                             "expand_share": a.expand_share,
                             "timing": True})
    model, tok = load_reference(a.model)
    router = None if no_router else SemanticRouter.load(a.router, model)
    items = build_items(tok, a.task, a.length, a.n, a.seed)
    res = time_methods(model, tok, items, names, a.budget, router, SegmentConfig(recent=a.recent, max_span=a.max_span),
                       a.repeats, methods.SekvOptions(memory=a.memory, slow=a.slow, bits=a.bits), a.expand_share)
    for m, row in res.items():
        print(m, row)
    append_run(a.out, {"timing": res}, rec.finish())


if __name__ == "__main__":
    main()
