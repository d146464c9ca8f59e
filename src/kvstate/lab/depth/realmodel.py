"""Cross-layer KV sharing applied post hoc (no training) to the real model on its real-text needle tasks.

The technique is cross-layer KV sharing at inference: a layer that is not an *owner* computes no K/V and attends
to an earlier owner's (:func:`kvstate.depth.sharing.apply_sharing`). Its families, from the library's registry
(:data:`kvstate.depth.registry.FAMILIES`) and one routing rule (:data:`kvstate.depth.registry.RULES`):

- ``keep``: owners spread evenly ("Layer-Condensed KV Cache for Efficient Inference of Large Language Models");
- ``cla``: runs of ``k`` adjacent layers read the first's K/V (CLA, "Reducing Transformer Key-Value Cache Size
  with Cross-Layer Attention", Brandon et al. 2024; ``k = 2`` is CLA2);
- ``top_shared``: the top layers read the last owner below them (Gemma 3n's KV sharing);
- ``rcla``: one seeded draw of Random Cross-Layer Attention ("Stochastic KV Routing") with exactly the kept
  number of owners — the ``owner`` rule's draw (:func:`kvstate.depth.patterns.draw_pattern`, each routed layer
  reads a uniformly chosen earlier owner: the deployable patterns an R-CLA model is meant to serve), redrawn from
  one ``random.Random(draw_seed)`` until the owner count is right.

**A nominal keep on L layers** (:func:`plan`; L = 30 on SmolLM2-135M, where 0.75 and 0.25 of 30 are not whole):
``keep``, ``top_shared`` and ``rcla`` keep ``floor(keep * L)`` owners (at most the nominal bytes: 22, 15 and 7 of
30, i.e. 0.733 / 0.5 / 0.233); ``cla`` takes ``k = round(1 / keep)`` (0.5: CLA2, 15 owners; 0.25: CLA4, 8
owners, 0.267 — the one family that holds more than the nominal bytes; 0.75: no whole k > 1, not run). Identical
patterns (on 30 layers ``keep`` at 0.5 *is* CLA2) are run once and scored under every label.

**Item-major** through the lab's loop (:func:`kvstate.lab.experiment.run_items`: the output checked before the
weights load, a journal so an interrupted run resumes, one row schema, the full cache as the reference that
decides the solved cells): an item is built once (:func:`kvstate.lab.workloads.realtext.make_item`), scored
under the full cache and then under each pattern, each a greedy ``generate`` scored as RULER's
``string_match_all`` (:func:`kvstate.lab.models.realtext_eval.score_item`, the reference table's function and
reply budget). No prefill is shared between patterns: from a pattern's first non-owner on, every layer's input
differs from the full cache's. Run as a module::

    OMP_NUM_THREADS=1 python -m kvstate.lab.depth.realmodel --n 20 --seed 451 --budget-min 50 \\
        --out docs/results/smollm2_depth_posthoc_pilot.json

``--budget-min`` times the first item under every pattern and, when the run would exceed the budget, keeps
keep 0.5 of every family plus the other keeps of ``keep`` (:func:`reduced`; ``--reduced`` runs that set
directly, e.g. to resume a cut run). Ignored: per-KV-head sharing (the
library shares whole layers), perplexity, bytes and speed (a pattern's KV bytes are its owners' share by
construction: reported as ``kept``), a cross-layer low-rank (xKV-style) baseline.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstate.errors import KVStateError

EXPERIMENT = "depth-posthoc-real"
FULL = "full"  # the loop's name for the unmodified model (every layer its own K/V): the reference
TASKS = ("niah_single", "niah_multikey")
KEEPS = (0.75, 0.5, 0.25)
RCLA = "rcla"  # the family of seeded R-CLA draws (owner rule) with a given owner count
ANCHOR = 0.5  # every family at this keep survives a cut (reduced())
MAX_REDRAWS = 100_000


@dataclass(frozen=True)
class Posthoc:
    """One row of the table: a family's pattern at a nominal keep."""

    label: str  # the loop's name, e.g. "top_shared@0.5"
    family: str  # a registered family, or RCLA
    keep: float  # the nominal kept fraction asked for
    pattern: Any  # kvstate.depth.patterns.SharingPattern
    kept: float  # owners / attention layers actually kept

    def describe(self) -> dict[str, Any]:
        from kvstate.depth.patterns import format_pattern

        src = self.pattern.sources
        return {"family": self.family, "keep": self.keep, "kept": round(self.kept, 4),
                "owners": len(self.pattern.owners), "pattern": format_pattern(self.pattern),
                "shared": {str(i): s for i, s in enumerate(src) if s != i}}  # non-owner layer -> the layer it reads


def _attention(layers: Sequence[Any]) -> int:
    return sum(spec.is_attention for spec in layers)


def kept_owners(layers: Sequence[Any], keep: float) -> int:
    """Owners a nominal ``keep`` allows on ``layers``: ``floor(keep * attention layers)``, at least one."""
    if not 0 < keep <= 1:
        raise KVStateError(f"keep {keep!r} must be a kept fraction in (0, 1], e.g. 0.5")
    return max(1, math.floor(keep * _attention(layers) + 1e-9))


def _keep(layers: Sequence[Any], keep: float) -> Any:
    from kvstate.depth.registry import FAMILIES

    return FAMILIES.get("keep").build(layers, kept_owners(layers, keep) / _attention(layers))


def _cla(layers: Sequence[Any], keep: float) -> Any:
    from kvstate.depth.registry import FAMILIES

    k = round(1 / keep)
    return FAMILIES.get("cla").build(layers, k) if k > 1 else None  # 0.75: no whole group size > 1


def _top_shared(layers: Sequence[Any], keep: float) -> Any:
    from kvstate.depth.registry import FAMILIES

    return FAMILIES.get("top_shared").build(layers, _attention(layers) - kept_owners(layers, keep))


def rcla_draw(layers: Sequence[Any], keep: float, rng: random.Random) -> Any:
    """An R-CLA draw (the ``owner`` rule at p = ``keep``) with exactly :func:`kept_owners` owners, redrawn from
    ``rng`` until it has them."""
    from kvstate.depth.registry import RULES

    want = kept_owners(layers, keep)
    draw = RULES.get("owner").draw
    for _ in range(MAX_REDRAWS):
        pattern = draw(layers, keep, rng)
        if sum(pattern.is_owner(i) for i, spec in enumerate(layers) if spec.is_attention) == want:
            return pattern.validate(layers)
    raise KVStateError(f"rcla: no draw at p = {keep:g} kept {want} caches in {MAX_REDRAWS:,} tries")


# family -> its pattern at a nominal keep (None: the family has none there); the names are the registry's
FAMILY_AT: dict[str, Callable[[Sequence[Any], float], Any]] = {"keep": _keep, "cla": _cla, "top_shared": _top_shared}
FAMILY_ORDER = ("keep", "cla", "top_shared", RCLA)


def plan(layers: Sequence[Any], keeps: Sequence[float] = KEEPS, families: Sequence[str] = FAMILY_ORDER,
         draw_seed: int = 0) -> list[Posthoc]:
    """Every family's pattern at every nominal keep (a family without one at a keep is left out), in family then
    keep order; ``rcla`` patterns come from one ``random.Random(draw_seed)`` in keep order."""
    from kvstate.depth.patterns import kept_fraction
    from kvstate.depth.registry import FAMILIES

    rng = random.Random(draw_seed)
    out = []
    for fam in families:
        if fam != RCLA:
            FAMILIES.get(fam)  # refuses a name the registry does not hold, listing it
            if fam not in FAMILY_AT:
                raise KVStateError(f"family {fam!r} has no pattern per kept fraction; choose from "
                                   f"{', '.join(FAMILY_ORDER)}")
        for keep in keeps:
            pattern = rcla_draw(layers, keep, rng) if fam == RCLA else FAMILY_AT[fam](layers, keep)
            if pattern is not None:
                out.append(Posthoc(f"{fam}@{keep:g}", fam, keep, pattern, kept_fraction(pattern, layers)))
    return out


def reduced(rows: Sequence[Posthoc]) -> list[Posthoc]:
    """The cut when the full table does not fit the budget: keep 0.5 of every family, every keep of ``keep``."""
    return [r for r in rows if math.isclose(r.keep, ANCHOR) or r.family == FAMILY_ORDER[0]]


def unique(rows: Sequence[Posthoc]) -> dict[str, str]:
    """label -> the first label with the same pattern (itself when first): one run per distinct pattern."""
    first: dict[Any, str] = {}
    return {r.label: first.setdefault(r.pattern, r.label) for r in rows}


def experiment(model_dir: Path, rows: Sequence[Posthoc], tasks: Sequence[str], lengths: Sequence[int], n: int,
               seed: int, new_tokens: int, draw_seed: int) -> Any:
    from kvstate.lab.experiment import Experiment
    from kvstate.lab.workloads import realtext as rt

    return Experiment(axis="depth", name=EXPERIMENT, methods=(FULL, *(r.label for r in rows)), seeds=(seed,),
                      tasks=tuple(tasks), lengths=tuple(lengths), n=n, reference=FULL,
                      code=("depth", "models", "lab/depth/realmodel.py", "lab/workloads/realtext.py",
                            "lab/models/realtext_eval.py", "lab/scoring.py"),
                      models=(str(model_dir),),
                      settings={"patterns": {r.label: r.describe() for r in rows}, "same_pattern": unique(rows),
                                "new_tokens": new_tokens, "draw_seed": draw_seed, "source": rt.SOURCE,
                                "post_hoc": True, "threads": 1, "dtype": "float32",
                                "keep_rule": "keep / top_shared / rcla: floor(keep * L) owners; cla: k = round(1/keep)"})


class Measure:
    """Scores the full cache and every pattern on one item (:func:`kvstate.lab.experiment.run_items`'s function)."""

    def __init__(self, model: Any, tokenizer: Any, rows: Sequence[Posthoc], new_tokens: int,
                 say: Callable[[str], None] = lambda _m: None) -> None:
        self.model, self.tok, self.rows, self.new_tokens, self.say = model, tokenizer, list(rows), new_tokens, say
        self.same = unique(rows)
        self.seconds: list[float] = []  # wall seconds per item measured by this object

    def __call__(self, item: Any) -> Any:
        from kvstate.depth.sharing import apply_sharing
        from kvstate.lab.experiment import ItemResult
        from kvstate.lab.models.realtext_eval import score_item
        from kvstate.lab.workloads import realtext as rt

        t0 = time.perf_counter()
        x = rt.make_item(self.tok, item.task, item.length, item.seed, item.index)
        full, info = score_item(self.model, self.tok, x, self.new_tokens)
        scores = {FULL: full}
        extra: dict[str, Any] = {"depth": info["depth"], "answers": info["answers"], "prompt_tokens": len(x.prompt_ids),
                                 FULL: {"reply": info["reply"][:160], "seconds": info["seconds"]}}
        for r in self.rows:
            first = self.same[r.label]
            if first != r.label:  # the same pattern as an earlier label: its score, not a second run
                scores[r.label] = scores[first]
                extra[r.label] = {"same_as": first}
                continue
            with apply_sharing(self.model, r.pattern):
                scores[r.label], got = score_item(self.model, self.tok, x, self.new_tokens)
            extra[r.label] = {"reply": got["reply"][:160], "seconds": got["seconds"]}
        self.seconds.append(round(time.perf_counter() - t0, 2))
        self.say(f"{item.task} item {item.index}: {self.seconds[-1]} s; full {full:.2f}, "
                 + ", ".join(f"{r.label} {scores[r.label]:.2f}" for r in self.rows))
        return ItemResult(scores, {**extra, "seconds": self.seconds[-1]})


def summary(e: Any, records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Per pattern and task: score with its interval and the pattern's layers; per pattern the paired difference
    to the full cache per task and pooled over the cells the full cache solves (>= 0.9); at keep 0.5 the family
    closest to the full cache (highest pooled score; ties broken by the mean over every task)."""
    from kvstate.lab import protocol, stats

    seed = e.seeds[0]
    cells = [f"{t}@{length}" for length in e.lengths for t in e.tasks]
    scores = {m: {c: [float(r["scores"][m]) for r in records if f"{r['task']}@{r['length']}" == c] for c in cells}
              for m in e.methods}
    split = protocol.solved_tasks(scores[FULL])
    patterns = dict(e.settings["patterns"])
    rows, pairs = [], []
    for m in e.methods:
        for c in cells:
            est = stats.rate(scores[m][c], seed=seed)
            rows.append({"method": m, "cell": c, "n": est.n, "score": round(est.value, 4),
                         "ci": [round(est.lo, 4), round(est.hi, 4)]})
        if m == FULL:
            continue
        where = {c: (scores[m][c], scores[FULL][c]) for c in cells}
        if split.solved:
            where["pooled (solved)"] = (split.pool(scores[m]), split.pool(scores[FULL]))
        where["all cells"] = ([v for c in cells for v in scores[m][c]], [v for c in cells for v in scores[FULL][c]])
        for cell, (a, b) in where.items():
            d = stats.paired_difference(a, b, seed=seed)
            pairs.append({"method": m, "cell": cell, "n": d.n, "difference": round(d.value, 4),
                          "ci": [round(d.lo, 4), round(d.hi, 4)]})
    at = [m for m in e.methods if m != FULL and math.isclose(patterns[m]["keep"], ANCHOR)]

    def key(m: str) -> tuple[float, float]:
        solved = split.pool(scores[m]) if split.solved else []
        every = [v for c in cells for v in scores[m][c]]
        return (sum(solved) / len(solved) if solved else 0.0, sum(every) / len(every))

    best = max(at, key=key) if at else None
    closest = None
    if best is not None:
        diffs = {p["cell"]: p for p in pairs if p["method"] == best}
        closest = {"method": best, "family": patterns[best]["family"], "same_pattern_as": [
            m for m in at if e.settings["same_pattern"][m] == e.settings["same_pattern"][best] and m != best],
            "difference": diffs.get("pooled (solved)") or diffs["all cells"], "per_cell": [diffs[c] for c in cells]}
    return {"rows": rows, "pairs": pairs, "solved": split.solved, "excluded": split.excluded,
            "patterns": patterns, "closest_at_0.5": closest}


def print_table(s: Mapping[str, Any], say: Callable[[str], None]) -> None:
    pats = s["patterns"]
    say(f"{'method':<18}{'kept':>6}  {'cell':<20}{'n':>4}{'score':>7}  {'95% CI':<16}{'vs full (paired)':<28}")
    diff = {(p["method"], p["cell"]): p for p in s["pairs"]}
    for r in s["rows"]:
        kept = "1" if r["method"] == FULL else f"{pats[r['method']]['kept']:.3f}"
        d = diff.get((r["method"], r["cell"]))
        dtext = "" if d is None else f"{d['difference']:+.3f} [{d['ci'][0]:+.3f}, {d['ci'][1]:+.3f}]"
        say(f"{r['method']:<18}{kept:>6}  {r['cell']:<20}{r['n']:>4}{r['score']:>7.3f}  "
            f"[{r['ci'][0]:.3f}, {r['ci'][1]:.3f}]  {dtext}")
    for p in s["pairs"]:
        if p["cell"] == "pooled (solved)":
            say(f"{p['method']} - full, pooled over {', '.join(s['solved'])} (n={p['n']}): {p['difference']:+.3f} "
                f"[{p['ci'][0]:+.3f}, {p['ci'][1]:+.3f}]")
    for m, d in pats.items():
        say(f"{m}: owners {d['owners']} ({d['kept']:.3f}); shared (layer<-source) "
            + " ".join(f"{k}<-{v}" for k, v in d["shared"].items()))
    c = s["closest_at_0.5"]
    if c is not None:
        d = c["difference"]
        say(f"closest to the full cache at keep 0.5: {c['method']} (same pattern as {c['same_pattern_as'] or 'none'}): "
            f"{d['difference']:+.3f} [{d['ci'][0]:+.3f}, {d['ci'][1]:+.3f}] on {d['cell']} (n={d['n']})")


def main(argv: list[str] | None = None) -> int:
    import torch

    from kvstate.depth.attention import layer_specs
    from kvstate.lab.experiment import ItemResult, check_out, items, run_items
    from kvstate.lab.lists import parse_floats, parse_ints, parse_names
    from kvstate.lab.models.cli import REAL_MODEL, missing_hint
    from kvstate.lab.workloads import realtext as rt
    from kvstate.models.loading import load_config, load_model, load_tokenizer

    ap = argparse.ArgumentParser(prog="python -m kvstate.lab.depth.realmodel", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=REAL_MODEL)
    ap.add_argument("--keep", default=",".join(f"{k:g}" for k in KEEPS))
    ap.add_argument("--families", default=",".join(FAMILY_ORDER))
    ap.add_argument("--draw-seed", type=int, default=0, help="seed of the rcla draws")
    ap.add_argument("--task", default=",".join(TASKS))
    ap.add_argument("--length", default="1024")
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--new-tokens", type=int, default=48, help="reply budget floor (the reference table's)")
    ap.add_argument("--budget-min", type=float, default=None,
                    help="time the first item; if every item would take longer in all, run the reduced set")
    ap.add_argument("--reduced", action="store_true", help="run the reduced set (what --budget-min cuts to) directly, "
                    "e.g. to resume a run that was cut")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--overwrite", action="store_true")
    a = ap.parse_args(argv)

    def say(m: str) -> None:
        print(f"depth-posthoc: {m}", file=sys.stderr, flush=True)

    if not (a.model / "config.json").is_file():
        print(f"error: {missing_hint(a.model)}", file=sys.stderr)
        return 2
    try:
        keeps = parse_floats(a.keep, "--keep", lo=0.0, lo_open=True, hi=1.0, example="0.75,0.5,0.25")
        families = parse_names(a.families, "--families", list(FAMILY_ORDER))
        tasks = parse_names(a.task, "--task", list(rt.TASKS))
        lengths = parse_ints(a.length, "--length", lo=128, example="1024")
        layers = layer_specs(load_config(a.model))
        rows = plan(layers, keeps, families, a.draw_seed)
        if a.reduced:
            rows = reduced(rows)
        e = experiment(a.model, rows, tasks, lengths, a.n, a.seed, a.new_tokens, a.draw_seed)
        check_out(e, a.out, overwrite=a.overwrite)  # the output (and, under models/, the ledger) before the weights
        torch.set_num_threads(1)
        model, tok = load_model(a.model, torch.float32), load_tokenizer(a.model)
        probe: dict[str, Any] = {}
        if a.budget_min is not None:
            first = items(e)[0]
            m = Measure(model, tok, rows, a.new_tokens, say)
            probe[first.unit] = m(first)
            runs = 1 + len(set(unique(rows).values()))  # forwards per item: the full cache and each distinct pattern
            total = m.seconds[0] * len(items(e)) / 60
            say(f"measured {m.seconds[0]} s per item ({runs} generations: full + distinct patterns); "
                f"{len(items(e))} items -> {total:.1f} min (budget {a.budget_min:g} min)")
            if total > a.budget_min:
                rows = reduced(rows)
                e = experiment(a.model, rows, tasks, lengths, a.n, a.seed, a.new_tokens, a.draw_seed)
                cut = 1 + len(set(unique(rows).values()))
                say(f"over budget: cut to {', '.join(r.label for r in rows)} (about {total * cut / runs:.1f} min)")
                check_out(e, a.out, overwrite=a.overwrite)
        measure = Measure(model, tok, rows, a.new_tokens, say)
        kept: dict[str, dict[str, Any]] = {}  # each item measured in this process: its scores and extra

        def fn(item: Any) -> Any:
            got = probe.pop(item.unit, None)
            if got is None:
                got = measure(item)
            else:  # the timing probe's item: the scores of the patterns the run kept
                names = set(e.methods)
                got = ItemResult({k: v for k, v in got.scores.items() if k in names},
                                 {k: v for k, v in got.extra.items() if k in names or k not in got.scores})
            kept[item.unit] = {"scores": dict(got.scores), "extra": dict(got.extra)}
            return got

        def appendix(journal: Any) -> dict[str, Any]:
            recs = [{"task": it.task, "length": it.length, "index": it.index,
                     **(journal.get(it.unit) if journal is not None else kept[it.unit])} for it in items(e)]
            return {"summary": summary(e, recs)}

        doc = run_items(e, fn, out=a.out, overwrite=a.overwrite, say=say, appendix=appendix,
                        command=" ".join(["python -m kvstate.lab.depth.realmodel",
                                          *(argv if argv is not None else sys.argv[1:])]))
        s = doc["appendix"]["summary"]
    except KVStateError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print_table(s, say)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
