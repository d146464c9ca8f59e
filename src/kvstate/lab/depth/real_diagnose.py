"""Which of the real model's layers need their own K/V for retrieval? A per-layer K/V ablation on dev seeds.

Technique: the single-layer ablation of cross-layer KV sharing (:mod:`kvstate.lab.depth.diagnose` does it on the
4-layer reference models; the retrieval-head literature — "Retrieval Head Mechanistically Explains Long-Context
Factuality" — finds a few layers / heads carry retrieval). On SmolLM2-135M-Instruct's 30 layers, for every layer
``l >= 1`` the model runs with layer ``l`` reading layer ``l - 1``'s K/V (every other layer its own: a deployable
CLA-style pattern with one shared layer) on the real-text needle tasks, and the answer is **teacher-forced**: one
forward over the prompt and the model's own reply format (:func:`kvstate.lab.depth.realtrain.own_reply`), scored 1
when every answer token is the argmax (a sharper signal than a generated reply at this n, and one forward per
pattern), with the answer tokens' mean NLL beside it. The NLL rise per layer is what a per-layer R-CLA ``p``
(a layer that must keep its own K/V at ``p = 1``) would be chosen from.

Dev seeds only (a diagnosis for choosing training options; a test seed is refused). Item-major through
:func:`kvstate.lab.experiment.run_items`. Run as a module::

    OMP_NUM_THREADS=1 python -m kvstate.lab.depth.real_diagnose --n 5 --seed 490 \\
        --out docs/results/smollm2_depth_diagnosis.json
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from kvstate.errors import KVStateError

EXPERIMENT = "depth-diagnose-real"
FULL = "full"
TASKS = ("niah_single", "niah_multikey")
DEV_LIMIT = 1000


def ablations(layers: Sequence[Any]) -> dict[str, Any]:
    """``share<l>`` -> the pattern where layer ``l`` reads layer ``l - 1``'s K/V, for every layer ``l >= 1``."""
    from kvstate.depth.patterns import SharingPattern

    n = len(layers)
    return {f"share{j}": SharingPattern(tuple(j - 1 if i == j else i for i in range(n))).validate(layers)
            for j in range(1, n)}


def answer_span(tok: Any, prompt: list[int], answers: tuple[str, ...]) -> tuple[list[int], int, int]:
    """(ids of prompt + own reply, first and end index of the answer's tokens in them)."""
    from kvstate.lab.depth.realtrain import own_reply

    reply = own_reply(tok, prompt, answers)
    head = reply[: reply.index(answers[0])]
    pre = tok(head, add_special_tokens=False)["input_ids"]
    full = tok(reply, add_special_tokens=False)["input_ids"]
    ans = tok(head + answers[0], add_special_tokens=False)["input_ids"]
    if full[: len(pre)] != pre or ans[: len(pre)] != pre:
        raise KVStateError(f"the reply {reply!r} does not tokenize with its answer apart; choose another item")
    return prompt + [int(i) for i in full], len(prompt) + len(pre), len(prompt) + len(ans)


@torch.inference_mode()
def teacher_forced(model: Any, ids: list[int], start: int, end: int) -> tuple[float, float]:
    """(1.0 if every answer token ``ids[start:end]`` is the argmax given the ids before it else 0.0, its mean NLL)."""
    logits = model(torch.tensor([ids]), use_cache=False).logits[0, start - 1:end - 1].float()
    target = torch.tensor(ids[start:end])
    nll = torch.nn.functional.cross_entropy(logits, target).item()
    return float(bool((logits.argmax(-1) == target).all())), round(nll, 4)


class Measure:
    def __init__(self, model: Any, tok: Any, patterns: dict[str, Any], say: Any) -> None:
        self.model, self.tok, self.patterns, self.say = model, tok, patterns, say

    def __call__(self, item: Any) -> Any:
        from kvstate.depth.sharing import apply_sharing
        from kvstate.lab.experiment import ItemResult
        from kvstate.lab.workloads import realtext as rt

        t0 = time.perf_counter()
        x = rt.make_item(self.tok, item.task, item.length, item.seed, item.index)
        ids, start, end = answer_span(self.tok, list(x.prompt_ids), x.answers)
        scores, nll = {}, {}
        scores[FULL], nll[FULL] = teacher_forced(self.model, ids, start, end)
        for name, pattern in self.patterns.items():
            with apply_sharing(self.model, pattern):
                scores[name], nll[name] = teacher_forced(self.model, ids, start, end)
        worst = max(nll, key=nll.__getitem__)
        self.say(f"{item.task} item {item.index}: {time.perf_counter() - t0:.0f} s; full NLL {nll[FULL]}, "
                 f"worst {worst} {nll[worst]}")
        return ItemResult(scores, {"nll": nll, "answer_tokens": end - start})


def summary(records: Sequence[dict[str, Any]], names: Sequence[str]) -> dict[str, Any]:
    """Per ablation: the exact-answer rate and the mean answer NLL over every item, and its rise over the full
    cache's, sorted by that rise."""
    rows = []
    full = sum(r["extra"]["nll"][FULL] for r in records) / len(records)
    for m in [FULL, *names]:
        nll = sum(r["extra"]["nll"][m] for r in records) / len(records)
        rows.append({"method": m, "exact": round(sum(r["scores"][m] for r in records) / len(records), 4),
                     "nll": round(nll, 4), "nll_rise": round(nll - full, 4)})
    return {"rows": sorted(rows, key=lambda r: -r["nll_rise"]), "items": len(records)}


def main(argv: list[str] | None = None) -> int:
    from kvstate.depth.attention import layer_specs
    from kvstate.lab.experiment import Experiment, check_out, items, run_items
    from kvstate.lab.models.cli import REAL_MODEL, missing_hint
    from kvstate.lab.workloads import realtext as rt
    from kvstate.models.loading import load_model, load_tokenizer

    ap = argparse.ArgumentParser(prog="python -m kvstate.lab.depth.real_diagnose", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=REAL_MODEL)
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--n", type=int, default=5)
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--overwrite", action="store_true")
    a = ap.parse_args(argv)

    def say(m: str) -> None:
        print(f"depth-diagnose: {m}", file=sys.stderr, flush=True)

    if not (a.model / "config.json").is_file():
        print(f"error: {missing_hint(a.model)}", file=sys.stderr)
        return 2
    try:
        if not 0 <= a.seed < DEV_LIMIT:
            raise KVStateError(f"--seed {a.seed}: the diagnosis chooses training options, so it runs on dev seeds "
                               f"(0..{DEV_LIMIT - 1}) only")
        torch.set_num_threads(1)
        model, tok = load_model(a.model, torch.float32), load_tokenizer(a.model)
        patterns = ablations(layer_specs(model.config))
        e = Experiment(axis="depth", name=EXPERIMENT, methods=(FULL, *patterns), seeds=(a.seed,), tasks=TASKS,
                       lengths=(a.length,), n=a.n, reference=FULL,
                       code=("depth", "models", "lab/depth/real_diagnose.py", "lab/depth/realtrain.py",
                             "lab/workloads/realtext.py"), models=(str(a.model),),
                       settings={"ablation": "layer l reads layer l - 1's K/V", "scoring": "teacher-forced answer",
                                 "source": rt.SOURCE, "threads": 1, "dtype": "float32"})
        check_out(e, a.out, overwrite=a.overwrite)
        measure = Measure(model, tok, patterns, say)
        kept: dict[str, Any] = {}

        def fn(item: Any) -> Any:
            got = measure(item)
            kept[item.unit] = {"scores": dict(got.scores), "extra": dict(got.extra)}
            return got

        def appendix(journal: Any) -> dict[str, Any]:
            recs = [journal.get(it.unit) if journal is not None else kept[it.unit] for it in items(e)]
            return {"summary": summary(recs, list(patterns))}

        doc = run_items(e, fn, out=a.out, overwrite=a.overwrite, say=say, appendix=appendix,
                        command=" ".join(["python -m kvstate.lab.depth.real_diagnose",
                                          *(argv if argv is not None else sys.argv[1:])]))
    except KVStateError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for r in doc["appendix"]["summary"]["rows"][:10]:
        say(f"{r['method']:<8} exact {r['exact']:.2f}  answer NLL {r['nll']:.3f} ({r['nll_rise']:+.3f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
