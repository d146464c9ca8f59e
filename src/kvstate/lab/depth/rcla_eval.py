"""Fine-tuned cross-layer KV sharing on the real model: R-CLA and the CLA2 specialist over a declared keep-0.5 family.

Technique: Random Cross-Layer Attention ("Stochastic KV Routing") — one model meant to serve every pattern of a
family — against a specialist trained on one fixed pattern (CLA2, Brandon et al. 2024), both LoRA fine-tunes of
SmolLM2-135M-Instruct (:mod:`kvstate.lab.depth.realtrain`), scored against the **unmodified** model, which is the
reference of every comparison (its scores decide the solved cells).

**The declared family at keep 0.5** (:func:`family`): 15 of 30 layers own K/V in every pattern — ``keep@0.5``
(layers spread evenly; on 30 layers this *is* CLA2, the specialist's own pattern), ``top_shared@0.5`` (layers
15–29 read layer 14: Gemma 3n's sharing), ``draws`` seeded R-CLA draws (the ``owner`` rule, exactly 15
owners; :func:`kvstate.lab.depth.realmodel.rcla_draw`) and ``nearest`` seeded nearest-owner draws (15 owners, each
non-owner reading the closest owner below: :mod:`kvstate.lab.depth.nearest`). Each fine-tuned model is scored on its own K/V (keep 1)
and under every pattern of the family; the family's **worst** and **mean** pattern per model are the numbers
the depth claim is about.

**Item-major** through the lab's loop (:func:`kvstate.lab.experiment.run_items`; a journal, so an interrupted run
resumes): an item is built once and every model answers it under every pattern, each a greedy ``generate``
scored as RULER's ``string_match_all`` (:func:`kvstate.lab.models.realtext_eval.score_item`, the reference
table's function and reply budget). Run as a module::

    OMP_NUM_THREADS=1 python -m kvstate.lab.depth.rcla_eval --model rcla=runs/depth/pilot-rcla-model \\
        --model cla2=runs/depth/pilot-cla2-model --n 10 --seed 489 --out docs/results/smollm2_depth_ft_pilot.json

Ignored: perplexity and decode speed (their own runs), per-KV-head sharing.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvstate.errors import KVStateError

EXPERIMENT = "depth-finetuned-real"
BASE = "base"  # the unmodified model: the reference
KEEP = 0.5
SEP = ":"  # method names: "<model>" (its own K/V) and "<model>:<pattern>"


NEAREST = "near"  # the family of nearest-owner draws (kvstate.lab.depth.nearest)


def family(layers: Sequence[Any], draws: int, draw_seed: int = 0, nearest: int = 0) -> list[Any]:
    """The declared keep-0.5 family (:class:`kvstate.lab.depth.realmodel.Posthoc` rows): keep, top_shared,
    ``draws`` R-CLA draws (``owner`` rule) and ``nearest`` nearest-owner draws, every one with the same owner count;
    a draw equal to an earlier pattern is redrawn."""
    from kvstate.depth.patterns import kept_fraction
    from kvstate.lab.depth import nearest as near
    from kvstate.lab.depth import realmodel as rm

    rows = [rm.Posthoc(f"{fam}@{KEEP:g}", fam, KEEP, rm.FAMILY_AT[fam](layers, KEEP), 0.0)
            for fam in ("keep", "top_shared")]
    rng = random.Random(draw_seed)
    seen = {r.pattern for r in rows}
    while sum(r.family == rm.RCLA for r in rows) < draws:
        p = rm.rcla_draw(layers, KEEP, rng)
        if p not in seen:
            seen.add(p)
            rows.append(rm.Posthoc(f"rcla{sum(r.family == rm.RCLA for r in rows) + 1}@{KEEP:g}", rm.RCLA, KEEP, p, 0.0))
    rng = random.Random(draw_seed)
    owners = rm.kept_owners(layers, KEEP)
    while sum(r.family == NEAREST for r in rows) < nearest:
        p = near.draw_exact(layers, owners, rng)
        if p not in seen:
            seen.add(p)
            rows.append(rm.Posthoc(f"{NEAREST}{sum(r.family == NEAREST for r in rows) + 1}@{KEEP:g}", NEAREST, KEEP,
                                   p, 0.0))
    return [rm.Posthoc(r.label, r.family, r.keep, r.pattern, kept_fraction(r.pattern, layers)) for r in rows]


def method_names(models: Sequence[str], rows: Sequence[Any]) -> tuple[str, ...]:
    return (BASE, *(n for m in models for n in (m, *(f"{m}{SEP}{r.label}" for r in rows))))


def parse_models(specs: Sequence[str]) -> dict[str, Path]:
    """``name=dir`` pairs, in order; a name is refused when it is the reference's, repeated, or holds ``:``."""
    out: dict[str, Path] = {}
    for s in specs:
        name, eq, path = s.partition("=")
        if not eq or not name or not path or SEP in name or name == BASE or name in out:
            raise KVStateError(f"--model {s!r}: give NAME=DIR with a new name other than {BASE!r} and without "
                               f"{SEP!r}, e.g. rcla=runs/depth/pilot-rcla-model")
        if not (Path(path) / "config.json").is_file():
            raise KVStateError(f"--model {s!r}: {path} holds no model (config.json); build it with "
                               "python -m kvstate.lab.depth.realtrain build")
        out[name] = Path(path)
    if not out:
        raise KVStateError("name at least one fine-tuned model with --model NAME=DIR")
    return out


class Measure:
    """Scores the unmodified model, then every fine-tuned model on its own K/V and under every pattern, on one item."""

    def __init__(self, models: Mapping[str, Any], tokenizer: Any, rows: Sequence[Any], new_tokens: int,
                 say: Callable[[str], None] = lambda _m: None) -> None:
        self.models, self.tok, self.rows, self.new_tokens, self.say = dict(models), tokenizer, list(rows), new_tokens, say

    def __call__(self, item: Any) -> Any:
        from kvstate.depth.sharing import apply_sharing
        from kvstate.lab.experiment import ItemResult
        from kvstate.lab.models.realtext_eval import score_item
        from kvstate.lab.workloads import realtext as rt

        t0 = time.perf_counter()
        x = rt.make_item(self.tok, item.task, item.length, item.seed, item.index)
        scores: dict[str, float] = {}
        extra: dict[str, Any] = {"answers": list(x.answers), "prompt_tokens": len(x.prompt_ids)}
        for name, model in self.models.items():
            scores[name], got = score_item(model, self.tok, x, self.new_tokens)
            extra[name] = {"reply": got["reply"][:120]}
            if name == BASE:
                continue
            for r in self.rows:
                key = f"{name}{SEP}{r.label}"
                with apply_sharing(model, r.pattern):
                    scores[key], got = score_item(model, self.tok, x, self.new_tokens)
                extra[key] = {"reply": got["reply"][:120]}
        seconds = round(time.perf_counter() - t0, 2)
        self.say(f"{item.task} item {item.index}: {seconds} s; " + ", ".join(f"{k} {v:.2f}" for k, v in scores.items()))
        return ItemResult(scores, {**extra, "seconds": seconds})


def summary(e: Any, records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Per method and cell: score and interval; per method the paired difference to the unmodified model per cell
    and pooled over the cells it solves (>= 0.9); per fine-tuned model its family's worst and mean pattern."""
    from kvstate.lab import protocol, stats

    seed = e.seeds[0]
    cells = [f"{t}@{length}" for length in e.lengths for t in e.tasks]
    scores = {m: {c: [float(r["scores"][m]) for r in records if f"{r['task']}@{r['length']}" == c] for c in cells}
              for m in e.methods}
    split = protocol.solved_tasks(scores[BASE])
    rows, pairs = [], []
    for m in e.methods:
        for c in cells:
            est = stats.rate(scores[m][c], seed=seed)
            rows.append({"method": m, "cell": c, "n": est.n, "score": round(est.value, 4),
                         "ci": [round(est.lo, 4), round(est.hi, 4)]})
        if m == BASE:
            continue
        where = {c: (scores[m][c], scores[BASE][c]) for c in cells}
        if split.solved:
            where["pooled (solved)"] = (split.pool(scores[m]), split.pool(scores[BASE]))
        for cell, (a, b) in where.items():
            d = stats.paired_difference(a, b, seed=seed)
            pairs.append({"method": m, "cell": cell, "n": d.n, "difference": round(d.value, 4),
                          "ci": [round(d.lo, 4), round(d.hi, 4)]})

    def pooled(m: str) -> float:
        vals = split.pool(scores[m]) if split.solved else [v for c in cells for v in scores[m][c]]
        return sum(vals) / len(vals) if vals else 0.0

    models = [m for m in e.methods if m != BASE and SEP not in m]
    per_model = {}
    for name in models:
        fam = {m: pooled(m) for m in e.methods if m.startswith(name + SEP)}
        worst = min(fam, key=fam.__getitem__)
        per_model[name] = {"own_kv": round(pooled(name), 4), "worst": worst, "worst_score": round(fam[worst], 4),
                           "mean": round(sum(fam.values()) / len(fam), 4),
                           "patterns": {k.split(SEP, 1)[1]: round(v, 4) for k, v in fam.items()}}
    return {"rows": rows, "pairs": pairs, "solved": split.solved, "excluded": split.excluded,
            "reference": round(pooled(BASE), 4), "models": per_model}


def print_table(s: Mapping[str, Any], say: Callable[[str], None]) -> None:
    diff = {(p["method"], p["cell"]): p for p in s["pairs"]}
    say(f"{'method':<28}{'cell':<20}{'n':>4}{'score':>7}  {'95% CI':<16}{'vs base (paired)':<28}")
    for r in s["rows"]:
        d = diff.get((r["method"], r["cell"]))
        dtext = "" if d is None else f"{d['difference']:+.3f} [{d['ci'][0]:+.3f}, {d['ci'][1]:+.3f}]"
        say(f"{r['method']:<28}{r['cell']:<20}{r['n']:>4}{r['score']:>7.3f}  [{r['ci'][0]:.3f}, {r['ci'][1]:.3f}]  {dtext}")
    say(f"pooled over {', '.join(s['solved']) or 'every cell (none solved)'}: base {s['reference']:.3f}")
    for name, m in s["models"].items():
        say(f"{name}: own K/V {m['own_kv']:.3f}; keep {KEEP:g} family worst {m['worst']} {m['worst_score']:.3f}, "
            f"mean {m['mean']:.3f}")


def experiment(base: Path, models: Mapping[str, Path], rows: Sequence[Any], tasks: Sequence[str],
               lengths: Sequence[int], n: int, seed: int, new_tokens: int, draw_seed: int) -> Any:
    from kvstate.lab.experiment import Experiment
    from kvstate.lab.workloads import realtext as rt

    return Experiment(axis="depth", name=EXPERIMENT, methods=method_names(list(models), rows), seeds=(seed,),
                      tasks=tuple(tasks), lengths=tuple(lengths), n=n, reference=BASE,
                      code=("depth", "models", "lab/depth/rcla_eval.py", "lab/depth/realmodel.py",
                            "lab/workloads/realtext.py", "lab/models/realtext_eval.py", "lab/scoring.py"),
                      models=(str(base), *(str(p) for p in models.values())),
                      settings={"patterns": {r.label: r.describe() for r in rows}, "models": {
                          k: str(v) for k, v in models.items()}, "new_tokens": new_tokens, "draw_seed": draw_seed,
                          "source": rt.SOURCE, "threads": 1, "dtype": "float32"})


def main(argv: list[str] | None = None) -> int:
    import torch

    from kvstate.depth.attention import layer_specs
    from kvstate.lab.experiment import check_out, items, run_items
    from kvstate.lab.lists import parse_ints, parse_names
    from kvstate.lab.models.cli import REAL_MODEL, missing_hint
    from kvstate.lab.workloads import realtext as rt
    from kvstate.models.loading import load_config, load_model, load_tokenizer

    ap = argparse.ArgumentParser(prog="python -m kvstate.lab.depth.rcla_eval", description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", type=Path, default=REAL_MODEL, help="the unmodified model (the reference)")
    ap.add_argument("--model", action="append", default=[], help="NAME=DIR of a fine-tuned model (repeatable)")
    ap.add_argument("--draws", type=int, default=2, help="R-CLA draws (owner rule) in the family beside keep and "
                    "top_shared")
    ap.add_argument("--nearest", type=int, default=2, help="nearest-owner draws in the family")
    ap.add_argument("--draw-seed", type=int, default=0)
    ap.add_argument("--task", default="niah_single,niah_multikey")
    ap.add_argument("--length", default="1024")
    ap.add_argument("--n", type=int, default=10)
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--new-tokens", type=int, default=48, help="reply budget floor (the reference table's)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--overwrite", action="store_true")
    a = ap.parse_args(argv)

    def say(m: str) -> None:
        print(f"depth-finetuned: {m}", file=sys.stderr, flush=True)

    if not (a.base / "config.json").is_file():
        print(f"error: {missing_hint(a.base)}", file=sys.stderr)
        return 2
    try:
        models = parse_models(a.model)
        tasks = parse_names(a.task, "--task", list(rt.TASKS))
        lengths = parse_ints(a.length, "--length", lo=128, example="1024")
        if a.draws < 0 or a.nearest < 0:
            raise KVStateError(f"--draws {a.draws} / --nearest {a.nearest}: give counts >= 0 (the family has keep and "
                               "top_shared besides)")
        rows = family(layer_specs(load_config(a.base)), a.draws, a.draw_seed, a.nearest)
        e = experiment(a.base, models, rows, tasks, lengths, a.n, a.seed, a.new_tokens, a.draw_seed)
        check_out(e, a.out, overwrite=a.overwrite)  # the output (and, under models/, the ledger) before the weights
        torch.set_num_threads(1)
        loaded = {BASE: load_model(a.base, torch.float32), **{k: load_model(v, torch.float32) for k, v in models.items()}}
        measure = Measure(loaded, load_tokenizer(a.base), rows, a.new_tokens, say)
        kept: dict[str, dict[str, Any]] = {}

        def fn(item: Any) -> Any:
            got = measure(item)
            kept[item.unit] = {"scores": dict(got.scores), "extra": dict(got.extra)}
            return got

        def appendix(journal: Any) -> dict[str, Any]:
            recs = [{"task": it.task, "length": it.length, "index": it.index,
                     **(journal.get(it.unit) if journal is not None else kept[it.unit])} for it in items(e)]
            return {"summary": summary(e, recs)}

        doc = run_items(e, fn, out=a.out, overwrite=a.overwrite, say=say, appendix=appendix,
                        command=" ".join(["python -m kvstate.lab.depth.rcla_eval",
                                          *(argv if argv is not None else sys.argv[1:])]))
    except KVStateError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print_table(doc["appendix"]["summary"], say)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
