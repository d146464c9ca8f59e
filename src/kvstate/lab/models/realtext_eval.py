"""The real model's full-cache score on the real-text needle tasks (:mod:`kvstate.lab.workloads.realtext`).

One prefill per item, then greedy decoding through ``generate`` from that cache (at least ``new_tokens`` tokens,
more where the answers need it: a 7-digit number is 7 tokens here), the
reply scored as RULER's ``string_match_all``; per (task, length) the mean with its 95% interval
(:func:`kvstate.lab.stats.rate`) and the tasks the model solves (>= 0.9) or scores >= 0.5 on. Run as a module::

    python -m kvstate.lab.models.realtext_eval --length 1024,2048 --n 8 --seed 7 \\
        --out docs/results/smollm2_realtext_pilot.json

A pilot on a dev seed sizes the reference table (>= 100 items per cell on a test seed, in ``models/``).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from kvstate.lab.scoring import string_match_all
from kvstate.lab.workloads import realtext as rt

SOLVED, USABLE = 0.9, 0.5


def reply_budget(tokenizer: Any, item: rt.Item, floor: int) -> int:
    """New tokens for ``item``'s reply: ``floor``, or room for every answer (this tokenizer writes a digit per
    token) beside a short sentence, whichever is larger."""
    need = sum(len(tokenizer(" " + a)["input_ids"]) + 2 for a in item.answers) + 24
    return max(floor, need)


@torch.no_grad()
def reply(model: Any, tokenizer: Any, item: rt.Item, new_tokens: int) -> str:
    ids = torch.tensor([item.prompt_ids])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                         pad_token_id=tokenizer.eos_token_id)
    return str(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))


def evaluate(model: Any, tokenizer: Any, tasks: Sequence[str], lengths: Sequence[int], n: int, seed: int, *,
             new_tokens: int = 48, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """``{"cells": [per (task, length): mean, ci, n], "items": [per item: task, length, index, depth, score,
    reply], "solved": [...], "usable": [...]}``; items interleaved over tasks within a length."""
    from kvstate.lab.stats import rate

    rows: list[dict[str, Any]] = []
    for length in lengths:
        for i in range(n):
            for task in tasks:
                item = rt.make_item(tokenizer, task, length, seed, i)
                t = time.perf_counter()
                text = reply(model, tokenizer, item, reply_budget(tokenizer, item, new_tokens))
                rows.append({"task": task, "length": length, "index": i, "depth": round(item.depth, 3),
                             "score": string_match_all(text, item.answers), "answers": list(item.answers), "reply": text,
                             "seconds": round(time.perf_counter() - t, 2)})
                if progress:
                    progress(f"{length:,} tokens, item {i + 1}/{n}, {task}: {rows[-1]['score']:.2f} "
                             f"({rows[-1]['seconds']} s) {text[:60]!r}")
    cells = []
    for length in lengths:
        for task in tasks:
            est = rate([r["score"] for r in rows if r["task"] == task and r["length"] == length])
            cells.append({"task": task, "length": length, "mean": round(est.value, 4),
                          "ci": [round(est.lo, 4), round(est.hi, 4)], "n": est.n})
    return {"cells": cells, "items": rows,
            "solved": [f"{c['task']}@{c['length']}" for c in cells if c["mean"] >= SOLVED],
            "usable": [f"{c['task']}@{c['length']}" for c in cells if c["mean"] >= USABLE]}


def main(argv: list[str] | None = None) -> int:
    from kvstate.lab.cli_output import write_results
    from kvstate.lab.lists import parse_ints, parse_names
    from kvstate.lab.models.cli import REAL_MODEL, missing_hint
    from kvstate.lab.provenance import Recorder
    from kvstate.models.loading import load_model, load_tokenizer

    ap = argparse.ArgumentParser(prog="python -m kvstate.lab.models.realtext_eval", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=REAL_MODEL)
    ap.add_argument("--task", default=",".join(rt.TASKS))
    ap.add_argument("--length", default="1024,2048")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if not (args.model / "config.json").is_file():
        print(f"error: {missing_hint(args.model)}", file=sys.stderr)
        return 2
    tasks = parse_names(args.task, "--task", rt.TASKS)
    lengths = parse_ints(args.length, "--length", lo=128, example="1024,2048")
    torch.set_num_threads(1)
    rec = Recorder(code=("models", "lab/workloads/realtext.py", "lab/models/realtext_eval.py", "lab/scoring.py"),
                   models=[args.model], n=args.n, seeds=[args.seed], tasks=tasks, lengths=lengths,
                   settings={"new_tokens": args.new_tokens, "source": rt.SOURCE, "threads": 1, "dtype": "float32",
                             "kind": "quality", "pilot": args.seed < 1000})
    model, tok = load_model(args.model, torch.float32), load_tokenizer(args.model)
    result = evaluate(model, tok, tasks, lengths, args.n, args.seed, new_tokens=args.new_tokens,
                      progress=lambda m: print(f"realtext: {m}", file=sys.stderr, flush=True))
    for c in result["cells"]:
        print(f"{c['task']:>16} @ {c['length']:>5}: {c['mean']:.3f} [{c['ci'][0]:.3f}, {c['ci'][1]:.3f}] n={c['n']}",
              file=sys.stderr)
    if args.out is not None:
        write_results(args.out, {"model": str(args.model), **result}, rec.finish(), overwrite=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
