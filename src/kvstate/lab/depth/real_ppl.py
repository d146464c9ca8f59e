"""Held-out perplexity of the real model's depth fine-tunes under cross-layer KV sharing.

Technique: cross-layer KV sharing (R-CLA, "Stochastic KV Routing"; CLA2, Brandon et al. 2024) costs quality
beyond retrieval; the seed's second claim is that a model trained for sharing keeps its perplexity at keep 0.5
(issue 45's targets: <= 1.05x the unmodified model at keep 0.5, within 1% at keep 1). Here every model — the
unmodified SmolLM2-135M-Instruct (the reference) and each fine-tune of :mod:`kvstate.lab.depth.realtrain` — scores
windows of the held-out licence text (:func:`kvstate.lab.workloads.realtext.held_out_text`, never a haystack) on
its own K/V and under every pattern of the declared keep-0.5 family (:func:`kvstate.lab.depth.rcla_eval.family`),
with the lab's one perplexity measurement (:func:`kvstate.lab.perplexity.continuation_nll`, one forward per
window). The loop's score per window is the next-token top-1 accuracy; the summed NLL and token count go in each
item's ``extra``, and the appendix gives each method's pooled perplexity with its interval and its paired ratio to
the unmodified model's (windows resampled, :func:`kvstate.lab.stats.paired_perplexity_ratio`). Run as a module::

    OMP_NUM_THREADS=1 python -m kvstate.lab.depth.real_ppl --model cla2=runs/depth/pilot-cla2-model --n 12 \\
        --seed 491 --out docs/results/smollm2_depth_ft_ppl_pilot.json
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from kvstate.errors import KVStateError

EXPERIMENT = "depth-finetuned-ppl-real"
TASK = "heldout"


def windows(tok: Any, length: int, n: int) -> list[list[int]]:
    """The first ``n`` disjoint ``length``-token windows of the held-out text; refused if it has fewer."""
    from kvstate.lab.workloads import realtext as rt

    ids = tok(rt.held_out_text(), add_special_tokens=False)["input_ids"]
    if len(ids) < n * length:
        raise KVStateError(f"--n {n} windows of {length} tokens need {n * length} held-out tokens; the held-out text "
                           f"has {len(ids)}: ask for at most {len(ids) // length}")
    return [[int(i) for i in ids[k * length:(k + 1) * length]] for k in range(n)]


class Measure:
    def __init__(self, models: Mapping[str, Any], rows: Sequence[Any], texts: list[list[int]], say: Any) -> None:
        self.models, self.rows, self.texts, self.say = dict(models), list(rows), texts, say

    @torch.inference_mode()
    def __call__(self, item: Any) -> Any:
        from kvstate.depth.sharing import apply_sharing
        from kvstate.lab.depth.rcla_eval import BASE, SEP
        from kvstate.lab.experiment import ItemResult

        ids = torch.tensor([self.texts[item.index]])
        scores, extra = {}, {}

        def score(key: str, model: Any) -> None:
            logits = model(ids, use_cache=False).logits[0, :-1].float()
            target = ids[0, 1:]
            nll = torch.nn.functional.cross_entropy(logits, target, reduction="sum").item()
            scores[key] = float((logits.argmax(-1) == target).float().mean())
            extra[key] = {"nll": round(nll, 4), "tokens": int(target.numel())}

        for name, model in self.models.items():
            score(name, model)
            if name == BASE:
                continue
            for r in self.rows:
                with apply_sharing(model, r.pattern):
                    score(f"{name}{SEP}{r.label}", model)
        self.say(f"window {item.index}: " + ", ".join(
            f"{k} {torch.tensor(v['nll'] / v['tokens']).exp().item():.2f}" for k, v in extra.items()))
        return ItemResult(scores, extra)


def summary(e: Any, records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Per method: pooled perplexity [interval] and the paired ratio to the unmodified model's; per fine-tuned
    model its own-K/V ratio and its family's worst ratio."""
    from kvstate.lab import stats
    from kvstate.lab.depth.rcla_eval import BASE, SEP

    seed = e.seeds[0]

    def cols(m: str) -> tuple[list[float], list[float]]:
        return ([r["extra"][m]["nll"] for r in records], [r["extra"][m]["tokens"] for r in records])

    base_nll, base_tok = cols(BASE)
    rows = []
    for m in e.methods:
        nll, tok = cols(m)
        p = stats.perplexity(nll, tok, seed=seed)
        row = {"method": m, "ppl": round(p.value, 4), "ci": [round(p.lo, 4), round(p.hi, 4)], "windows": len(nll)}
        if m != BASE:
            r = stats.paired_perplexity_ratio(nll, tok, base_nll, base_tok, seed=seed)
            # paired_perplexity_ratio gives ppl(a) / ppl(b) - 1: stored as the ratio itself
            row["ratio"], row["ratio_ci"] = round(1 + r.value, 4), [round(1 + r.lo, 4), round(1 + r.hi, 4)]
        rows.append(row)
    by = {r["method"]: r for r in rows}
    models = {}
    for name in (m for m in e.methods if m != BASE and SEP not in m):
        fam = [r for r in rows if r["method"].startswith(name + SEP)]
        worst = max(fam, key=lambda r: r["ratio"])
        models[name] = {"own_ratio": by[name]["ratio"], "own_ratio_ci": by[name]["ratio_ci"],
                        "worst": worst["method"], "worst_ratio": worst["ratio"], "worst_ratio_ci": worst["ratio_ci"]}
    return {"rows": rows, "models": models}


def main(argv: list[str] | None = None) -> int:
    from kvstate.depth.attention import layer_specs
    from kvstate.lab.depth.rcla_eval import BASE, family, method_names, parse_models
    from kvstate.lab.experiment import Experiment, check_out, items, run_items
    from kvstate.lab.models.cli import REAL_MODEL, missing_hint
    from kvstate.lab.workloads import realtext as rt
    from kvstate.models.loading import load_config, load_model, load_tokenizer

    ap = argparse.ArgumentParser(prog="python -m kvstate.lab.depth.real_ppl", description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", type=Path, default=REAL_MODEL)
    ap.add_argument("--model", action="append", default=[], help="NAME=DIR of a fine-tuned model (repeatable)")
    ap.add_argument("--draws", type=int, default=2)
    ap.add_argument("--nearest", type=int, default=2)
    ap.add_argument("--length", type=int, default=512)
    ap.add_argument("--n", type=int, default=12, help="held-out windows")
    ap.add_argument("--seed", type=int, required=True, help="the intervals' bootstrap seed")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--overwrite", action="store_true")
    a = ap.parse_args(argv)

    def say(m: str) -> None:
        print(f"depth-ppl: {m}", file=sys.stderr, flush=True)

    if not (a.base / "config.json").is_file():
        print(f"error: {missing_hint(a.base)}", file=sys.stderr)
        return 2
    try:
        models = parse_models(a.model)
        rows = family(layer_specs(load_config(a.base)), a.draws, 0, a.nearest)
        e = Experiment(axis="depth", name=EXPERIMENT, methods=method_names(list(models), rows), seeds=(a.seed,),
                       tasks=(TASK,), lengths=(a.length,), n=a.n, reference=BASE,
                       code=("depth", "models", "lab/depth/real_ppl.py", "lab/depth/rcla_eval.py",
                             "lab/workloads/realtext.py"), models=(str(a.base), *(str(p) for p in models.values())),
                       settings={"patterns": {r.label: r.describe() for r in rows}, "source": rt.HELD_OUT,
                                 "score": "next-token top-1 accuracy per window", "threads": 1, "dtype": "float32"})
        check_out(e, a.out, overwrite=a.overwrite)
        torch.set_num_threads(1)
        tok = load_tokenizer(a.base)
        texts = windows(tok, a.length, a.n)
        loaded = {BASE: load_model(a.base, torch.float32), **{k: load_model(v, torch.float32) for k, v in models.items()}}
        measure = Measure(loaded, rows, texts, say)
        kept: dict[str, Any] = {}

        def fn(item: Any) -> Any:
            got = measure(item)
            kept[item.unit] = {"scores": dict(got.scores), "extra": dict(got.extra)}
            return got

        def appendix(journal: Any) -> dict[str, Any]:
            recs = [journal.get(it.unit) if journal is not None else kept[it.unit] for it in items(e)]
            return {"summary": summary(e, recs)}

        doc = run_items(e, fn, out=a.out, overwrite=a.overwrite, say=say, appendix=appendix,
                        command=" ".join(["python -m kvstate.lab.depth.real_ppl",
                                          *(argv if argv is not None else sys.argv[1:])]))
    except KVStateError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for name, m in doc["appendix"]["summary"]["models"].items():
        say(f"{name}: own K/V {m['own_ratio']:.3f}x the unmodified model's perplexity; keep-0.5 family worst "
            f"{m['worst']} {m['worst_ratio']:.3f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
