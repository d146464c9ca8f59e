"""The depth headline's perplexity run: R-CLA and the CLA2 specialist on held-out text under the declared keep-0.5
family, with issue 45's two perplexity targets decided by the run.

Technique: R-CLA ("Stochastic KV Routing") and CLA2 (Brandon et al. 2024) as LoRA fine-tunes of
SmolLM2-135M-Instruct (:mod:`kvstate.lab.depth.rcla_test` names the models and the family). The measurement is
:mod:`kvstate.lab.depth.real_ppl`'s (every 512-token window of the held-out licence text, one forward per model
and pattern, the paired ratio to the unmodified model's perplexity with windows resampled); this module fixes
what it scores and adds the decisions the loop's rate targets cannot express (a ratio of perplexities):

- every pattern of the family: R-CLA ≤ :data:`~kvstate.lab.depth.rcla_test.PPL_KEEP_HALF` × the unmodified model;
- R-CLA on its own K/V within :data:`~kvstate.lab.depth.rcla_test.PPL_KEEP_ONE` of it (both bounds);

each on its interval (:func:`kvstate.lab.stats.decide`; a straddling interval is undecided). Run as a module::

    OMP_NUM_THREADS=1 python -m kvstate.lab.depth.rcla_ppl --seed 1071 --out models/smollm2/depth_rcla_ppl.json
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvstate.errors import KVStateError
from kvstate.lab.depth import rcla_test

WINDOWS = 17  # every 512-token window of the held-out text (kvstate.lab.workloads.realtext.held_out_text)
LENGTH = 512


def decisions(summary: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The two perplexity targets from :func:`kvstate.lab.depth.real_ppl.summary`'s rows."""
    from kvstate.lab import protocol, stats

    rows = {r["method"]: r for r in summary["rows"]}
    fam = [r for m, r in rows.items() if m.startswith(rcla_test.RCLA + rcla_test.SEP)]
    out = []
    if fam:
        worst = max(fam, key=lambda r: r["ratio"])
        out.append({"label": f"R-CLA held-out perplexity, every keep-0.5 pattern <= {rcla_test.PPL_KEEP_HALF:g}x the "
                             "unmodified model", "method": worst["method"], "value": worst["ratio"],
                    "ci": worst["ratio_ci"], "n": worst["windows"],
                    "status": protocol.combine_status([stats.decide(r["ratio_ci"][0], r["ratio_ci"][1],
                                                                    rcla_test.PPL_KEEP_HALF, higher_is_better=False)
                                                       for r in fam])})
    own = rows.get(rcla_test.RCLA)
    if own is not None:
        lo, hi = own["ratio_ci"]
        out.append({"label": f"R-CLA held-out perplexity on its own K/V within {rcla_test.PPL_KEEP_ONE:.0%} of the "
                             "unmodified model", "method": rcla_test.RCLA, "value": own["ratio"], "ci": [lo, hi],
                    "n": own["windows"],
                    "status": protocol.combine_status([
                        stats.decide(lo, hi, 1 + rcla_test.PPL_KEEP_ONE, higher_is_better=False),
                        stats.decide(lo, hi, 1 - rcla_test.PPL_KEEP_ONE)])})
    return out


def experiment(rows: Sequence[Any], seed: int, n: int, base: Path, models: Mapping[str, Path]) -> Any:
    from kvstate.lab.depth import real_ppl
    from kvstate.lab.depth.rcla_eval import method_names
    from kvstate.lab.experiment import Experiment
    from kvstate.lab.workloads import realtext as rt

    return Experiment(axis="depth", name=real_ppl.EXPERIMENT, methods=method_names(list(models), rows), seeds=(seed,),
                      tasks=(real_ppl.TASK,), lengths=(LENGTH,), n=n, reference=rcla_test.BASE,
                      code=("depth", "models", "lab/depth/rcla_ppl.py", "lab/depth/real_ppl.py",
                            "lab/depth/rcla_eval.py", "lab/depth/rcla_test.py", "lab/workloads/realtext.py"),
                      models=(str(base), *(str(p) for p in models.values())),
                      settings={"patterns": {r.label: r.describe() for r in rows}, "family": dict(rcla_test.FAMILY),
                                "source": rt.HELD_OUT, "score": "next-token top-1 accuracy per window",
                                "ppl_keep_half": rcla_test.PPL_KEEP_HALF, "ppl_keep_one": rcla_test.PPL_KEEP_ONE,
                                "threads": 1, "dtype": "float32"})


def main(argv: list[str] | None = None) -> int:
    import torch

    from kvstate.depth.attention import layer_specs
    from kvstate.lab.depth import real_ppl
    from kvstate.lab.experiment import check_out, items, run_items
    from kvstate.lab.models.cli import REAL_MODEL
    from kvstate.models.loading import load_config, load_model, load_tokenizer

    ap = argparse.ArgumentParser(prog="python -m kvstate.lab.depth.rcla_ppl", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, required=True, help="a fresh test seed (the intervals' bootstrap seed)")
    ap.add_argument("--n", type=int, default=WINDOWS, help="held-out windows (the text has 17 of 512 tokens)")
    ap.add_argument("--base", type=Path, default=REAL_MODEL)
    ap.add_argument("--rcla", type=Path, default=rcla_test.MODELS[rcla_test.RCLA])
    ap.add_argument("--cla2", type=Path, default=rcla_test.MODELS[rcla_test.CLA2])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--overwrite", action="store_true")
    a = ap.parse_args(argv)

    def say(m: str) -> None:
        print(f"depth-rcla-ppl: {m}", file=sys.stderr, flush=True)

    models = {rcla_test.RCLA: a.rcla, rcla_test.CLA2: a.cla2}
    missing = rcla_test.missing_model(a.base, models.values())
    if missing:
        print(f"error: {missing}", file=sys.stderr)
        return 2
    try:
        rows = rcla_test.declared_family(layer_specs(load_config(a.base)))
        e = experiment(rows, a.seed, a.n, a.base, models)
        check_out(e, a.out, overwrite=a.overwrite)
        torch.set_num_threads(1)
        tok = load_tokenizer(a.base)
        texts = real_ppl.windows(tok, LENGTH, a.n)
        loaded = {rcla_test.BASE: load_model(a.base, torch.float32),
                  **{k: load_model(v, torch.float32) for k, v in models.items()}}
        measure = real_ppl.Measure(loaded, rows, texts, say)
        kept: dict[str, Any] = {}

        def fn(item: Any) -> Any:
            got = measure(item)
            kept[item.unit] = {"scores": dict(got.scores), "extra": dict(got.extra)}
            return got

        def appendix(journal: Any) -> dict[str, Any]:
            recs = [journal.get(it.unit) if journal is not None else kept[it.unit] for it in items(e)]
            s = real_ppl.summary(e, recs)
            return {"summary": s, "decisions": decisions(s)}

        doc = run_items(e, fn, out=a.out, overwrite=a.overwrite, say=say, appendix=appendix,
                        command=" ".join(["python -m kvstate.lab.depth.rcla_ppl",
                                          *(argv if argv is not None else sys.argv[1:])]))
    except KVStateError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for d in doc["appendix"]["decisions"]:
        say(f"{d['status']}: {d['label']}: {d['value']:.3f}x [{d['ci'][0]:.3f}, {d['ci'][1]:.3f}]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
