"""The real model's full-cache score on the real-text needle tasks (:mod:`kvstate.lab.workloads.realtext`).

One prefill per item, then greedy decoding through ``generate`` from that cache (at least ``new_tokens`` tokens,
more where the answers need it: a 7-digit number is 7 tokens here), the reply scored as RULER's
``string_match_all``. The run goes through the lab's item-major loop (:func:`kvstate.lab.experiment.run_items`:
the seed ledger before any work, a journal so an interrupted run resumes, one row schema with intervals), and
adds the held-out perplexity (disjoint licence texts, never haystack) as its appendix. :func:`summary` names the
cells the model solves (>= 0.9) and those it scores >= 0.5 on. Run as a module::

    python -m kvstate.lab.models.realtext_eval --length 1024 --n 100 --seed 1053 \\
        --out models/smollm2/realtext_1024.json

A pilot on a dev seed (``--out docs/results/...``) sizes the reference table (>= 100 items per cell on a test
seed, in ``models/``).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from functools import partial
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


EXPERIMENT, METHOD = "realtext-reference", "full-cache"
PPL_WINDOWS = 8  # held-out perplexity: at most this many disjoint windows per length


def score_item(model: Any, tokenizer: Any, item: rt.Item, new_tokens: int) -> tuple[float, dict[str, Any]]:
    """One item's ``string_match_all`` score and what is kept about it (depth, answers, reply, seconds)."""
    t = time.perf_counter()
    text = reply(model, tokenizer, item, reply_budget(tokenizer, item, new_tokens))
    return string_match_all(text, item.answers), {"depth": round(item.depth, 3), "answers": list(item.answers),
                                                  "reply": text, "seconds": round(time.perf_counter() - t, 2)}


def plan(model_dir: Path, tasks: Sequence[str], lengths: Sequence[int], n: int, seed: int,
         new_tokens: int) -> Any:
    """The reference experiment: the model's full cache on ``tasks`` x ``lengths``, ``n`` items per cell."""
    from kvstate.lab.experiment import Experiment

    return Experiment(axis="reference", name=EXPERIMENT, methods=(METHOD,), seeds=(seed,), tasks=tuple(tasks),
                      lengths=tuple(lengths), n=n,
                      code=("models", "lab/workloads/realtext.py", "lab/models/realtext_eval.py", "lab/scoring.py",
                            "lab/perplexity.py"),
                      models=(str(model_dir),),
                      settings={"new_tokens": new_tokens, "source": rt.SOURCE, "threads": 1, "dtype": "float32",
                                "ppl_windows": PPL_WINDOWS})


@torch.no_grad()
def held_out_perplexity(model: Any, tokenizer: Any, lengths: Sequence[int], journal: Any = None) -> dict[str, Any]:
    """Per length: perplexity over up to :data:`PPL_WINDOWS` disjoint ``length``-token windows of the held-out
    licence texts (never haystack), with a bootstrap interval over windows."""
    from kvstate.lab.journal import once
    from kvstate.lab.perplexity import continuation_nll
    from kvstate.lab.stats import perplexity

    ids = tokenizer(rt.held_out_text())["input_ids"]
    out: dict[str, Any] = {"source": list(rt.HELD_OUT), "tokens": len(ids), "lengths": {}}
    for length in lengths:
        windows = [ids[i:i + length] for i in range(0, len(ids) - length + 1, length)][:PPL_WINDOWS]

        def nll(w: list[int]) -> dict[str, Any]:
            return dict(vars(continuation_nll(model, w)))

        rows = [once(journal, f"ppl/{length}/{k}", partial(nll, w)) for k, w in enumerate(windows)]
        if not rows:
            out["lengths"][str(length)] = {"windows": 0, "why": f"the held-out text has {len(ids)} tokens"}
            continue
        est = perplexity([r["nll"] for r in rows], [r["tokens"] for r in rows])
        out["lengths"][str(length)] = {"windows": len(rows), "ppl": round(est.value, 4),
                                       "ci": [round(est.lo, 4), round(est.hi, 4)]}
    return out


def summary(doc: dict[str, Any]) -> dict[str, Any]:
    """The reference table of a result: per (task, length) mean, interval and n; the solved and usable cells."""
    cells = [{"task": r["task"], "length": r["length"], "mean": round(r["value"], 4),
              "ci": [round(r["ci"][0], 4), round(r["ci"][1], 4)], "n": r["n"], "seed": r["seed"]}
             for r in doc["rows"] if r["method"] == METHOD]
    return {"cells": cells, "solved": [f"{c['task']}@{c['length']}" for c in cells if c["mean"] >= SOLVED],
            "usable": [f"{c['task']}@{c['length']}" for c in cells if c["mean"] >= USABLE]}


def main(argv: list[str] | None = None) -> int:
    from kvstate.errors import KVStateError
    from kvstate.lab.experiment import ItemResult, check_out, run_items
    from kvstate.lab.lists import parse_ints, parse_names
    from kvstate.lab.models.cli import REAL_MODEL, missing_hint
    from kvstate.models.loading import load_model, load_tokenizer

    ap = argparse.ArgumentParser(prog="python -m kvstate.lab.models.realtext_eval", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=REAL_MODEL)
    ap.add_argument("--task", default=",".join(rt.TASKS))
    ap.add_argument("--length", default="1024,2048")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--no-ppl", action="store_true", help="skip the held-out perplexity")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--overwrite", action="store_true")
    args = ap.parse_args(argv)
    if not (args.model / "config.json").is_file():
        print(f"error: {missing_hint(args.model)}", file=sys.stderr)
        return 2
    try:
        tasks = parse_names(args.task, "--task", rt.TASKS)
        lengths = parse_ints(args.length, "--length", lo=128, example="1024,2048")
        e = plan(args.model, tasks, lengths, args.n, args.seed, args.new_tokens)
        check_out(e, args.out, overwrite=args.overwrite)
        torch.set_num_threads(1)
        model, tok = load_model(args.model, torch.float32), load_tokenizer(args.model)

        def say(m: str) -> None:
            print(f"realtext: {m}", file=sys.stderr, flush=True)

        def measure(item: Any) -> Any:
            x = rt.make_item(tok, item.task, item.length, item.seed, item.index)
            score, extra = score_item(model, tok, x, args.new_tokens)
            say(f"{item.length:,} tokens, item {item.index + 1}/{args.n}, {item.task}: {score:.2f} "
                f"({extra['seconds']} s) {extra['reply'][:60]!r}")
            return ItemResult({METHOD: score}, extra)

        doc = run_items(e, measure, out=args.out, overwrite=args.overwrite, say=say,
                        command=" ".join(["python -m kvstate.lab.models.realtext_eval", *(argv or sys.argv[1:])]),
                        appendix=None if args.no_ppl else
                        (lambda j: {"perplexity": held_out_perplexity(model, tok, lengths, j)}))
    except KVStateError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for c in summary(doc)["cells"]:
        print(f"{c['task']:>16} @ {c['length']:>5}: {c['mean']:.3f} [{c['ci'][0]:.3f}, {c['ci'][1]:.3f}] n={c['n']}",
              file=sys.stderr)
    for L, p in (doc.get("appendix") or {}).get("perplexity", {}).get("lengths", {}).items():
        print(f"held-out perplexity @ {L}: {p.get('ppl')} {p.get('ci')} over {p['windows']} windows", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
