"""Report section: cross-layer KV sharing and Random Cross-Layer Attention ("Stochastic KV Routing").

Reads the committed ``models/<name>/depth_eval.json`` files written by
``kvstate depth eval --model models/<name> --keep 1,0.75,0.5,0.25 --n 10 --json --out models/<name>/depth_eval.json``
(the measurement takes minutes per model, so the section only plots and checks it): quality (task
score and perplexity) against measured KV bytes per token, one curve per model — the base model with
sharing applied post hoc, the no-routing control, the CLA2 specialist and R-CLA — and one headline row
per target with the measured value.
"""

from __future__ import annotations

import json
from dataclasses import replace
from itertools import combinations
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from kvstate.lab import protocol, stats
from kvstate.lab.depth import ft_section, rcla_section, real_section
from kvstate.lab.provenance import Artifact, load_artifact
from kvstate.lab.report import floor
from kvstate.lab.report.html import Figure, HeadlineRow, Section, Table, artifact_row, check_row
from kvstate.lab.training.io import read_state

PAPER = "Stochastic KV routing: Random Cross-Layer Attention (R-CLA) for adaptive depth-wise KV cache sharing"

EVAL_FILE = "depth_eval.json"
TECH = "depth (cross-layer KV sharing, R-CLA)"
# model directory -> curve label; the R-CLA models are found by prefix
BASE, CONTROL, SPECIALIST, RCLA, KV1 = ("ref-attn", "ref-attn-norouting", "ref-attn-cla2", "ref-attn-rcla",
                                       "ref-attn-kv1")
LABELS = {BASE: "base, sharing post hoc", CONTROL: "no-routing control (p=1)", SPECIALIST: "CLA2 specialist",
          RCLA: "R-CLA p=0.5", "ref-attn-rcla075": "R-CLA p=0.75", KV1: "equal-KV dense (1 KV head)"}
CLA2 = "0_0_2_2"
COLORS = dict(zip(LABELS, ("C0", "C1", "C2", "C3", "C4", "C5"), strict=True))  # one colour per model in every plot
DECODE_FILE = "depth_decode.json"


def _patterns_at(n_layers: int, owners: int) -> int:
    """Sharing patterns of ``n_layers`` attention layers with exactly ``owners`` computing their own K/V (layer 0
    always does; every other layer reads an earlier owner's): the count a declared family is a part of."""
    total = 0
    for rest in combinations(range(1, n_layers), owners - 1):
        own = {0, *rest}
        ways = 1
        for i in range(n_layers):
            if i not in own:
                ways *= sum(1 for o in own if o < i)
        total += ways
    return total


def describe(models_dir: Path, name: str) -> str:
    """A model's label by what its training did (issue 42: a label says what a model is, not what it was meant to
    be): per-layer routing probabilities and how much of the keep-0.5 space its declared family covers."""
    path = models_dir / name / "training_state.json"
    if not path.is_file():
        return LABELS[name]
    depth = json.loads(path.read_text()).get("depth") or {}
    fam = depth.get("family") or {}
    if depth.get("p_layer"):
        p = ", ".join(f"{x:g}" for x in depth["p_layer"])
        half = fam.get("by_keep", {}).get("0.5")
        n = len(depth["p_layer"])
        cover = f"; {len(half)} of {_patterns_at(n, n // 2)} keep-0.5 patterns" if half is not None else ""
        return f"R-CLA, per-layer p = {p}{cover}"
    if depth.get("p") not in (None, 1, 1.0) and name != CONTROL:
        return f"R-CLA, p = {depth['p']:g} on every layer"
    return LABELS[name]


def eval_command(name: str) -> str:
    """The command that regenerates ``models/<name>/depth_eval.json`` (a run appended to the file)."""
    post_hoc = "" if name.startswith(RCLA) else " --post-hoc"  # sharing the other models were not trained for
    if name == RCLA:  # the full-budget run with layers 0 and 2 never routed: keep 0.25 is outside its family
        return f"kvstate depth eval --model models/{name} --keep 1,0.75,0.5 --n 25 --seed 1027 --json --out models/{name}/{EVAL_FILE}"
    return (f"kvstate depth eval --model models/{name} --keep 1,0.75,0.5,0.25 --n 25 --seed 1027{post_hoc} --json "
            f"--out models/{name}/{EVAL_FILE}")


def load_artifacts(models_dir: Path) -> dict[str, Artifact]:
    """Model name -> its committed ``depth_eval.json`` (the newest run) with its provenance status."""
    return {name: load_artifact(models_dir / name / EVAL_FILE, eval_command(name))
            for name in LABELS if (models_dir / name / EVAL_FILE).is_file()}


def load_results(models_dir: Path) -> dict[str, list[dict[str, Any]]]:
    """Model name -> result rows of its committed ``depth_eval.json`` (the newest run)."""
    return {name: _rows(a) for name, a in load_artifacts(models_dir).items() if a.run is not None}


def _rows(art: Artifact) -> list[dict[str, Any]]:
    """The run's result rows, each with the run's test seed (rows pair only with rows of the same seed and n)."""
    run = art.run or {}
    return [{**r, "seed": run.get("seed")} for r in run.get("results", [])]


def _worst(arts: list[Artifact]) -> Artifact:
    """The artifact a row combining several files stands on: a stale or missing one if any."""
    return next((a for a in arts if a.status != "current"), arts[0])


def _ci(row: dict[str, Any] | None, key: str) -> tuple[float, float] | None:
    ci = (row or {}).get(key)
    return (float(ci[0]), float(ci[1])) if ci else None


def _at(rows: list[dict[str, Any]], *, keep: float | None = None, pattern: str | None = None) -> dict[str, Any] | None:
    for r in rows:
        if (keep is None or abs(r["keep"] - keep) < 1e-9) and (pattern is None or r["pattern"] == pattern):
            return r
    return None


def _ppl_vs(a: dict[str, Any], b: dict[str, Any]) -> stats.Estimate | None:
    """``ppl(a) / ppl(b) - 1``, paired over the same texts when both rows keep per-text NLL (else None)."""
    ta, tb = a.get("text_nll"), b.get("text_nll")
    if not ta or not tb or len(ta) != len(tb) or a.get("seed") != b.get("seed"):
        return None
    (na, ka), (nb, kb) = zip(*ta, strict=True), zip(*tb, strict=True)
    return stats.paired_perplexity_ratio(na, ka, nb, kb) if ka == kb else None


def _common_items(a: dict[str, Any], b: dict[str, Any]) -> tuple[list[float], list[float]] | None:
    """Both rows' items on the (task, length) cells both their full caches solve, when both keep every cell."""
    cells, ca, cb = a.get("cells"), a.get("all_items"), b.get("all_items")
    if not cells or ca is None or cb is None or cells != b.get("cells") or len(ca) != len(cb) or len(ca) % len(cells):
        return None
    common, per = set(a.get("tasks") or ()) & set(b.get("tasks") or ()), len(ca) // len(cells)
    keep = [i for i, c in enumerate(cells) if c in common]
    return [x for i in keep for x in ca[i * per:(i + 1) * per]], [x for i in keep for x in cb[i * per:(i + 1) * per]]


def _score_vs(a: dict[str, Any], b: dict[str, Any], factor: float = 1.0) -> stats.Estimate | None:
    """Mean of ``a_i - factor * b_i`` over the same items (paired), when both rows keep per-item scores: the cells
    both full caches solve where the rows keep every cell (experiment-loop runs), else all items."""
    both = _common_items(a, b)
    ia, ib = both if both is not None else (a.get("items"), b.get("items"))
    if not ia or not ib or len(ia) != len(ib) or a.get("seed") != b.get("seed"):  # other items: no pairing
        return None
    return stats.paired_difference(ia, [factor * x for x in ib])


def _f3(x: float | None) -> str:
    return "—" if x is None else f"{x:.3f}"


def _signs(ppl: stats.Estimate | None, drop: stats.Estimate | None) -> str:
    """The paired intervals a 'measurably worse' row is decided on, in words."""
    out = []
    if ppl is not None:
        out.append(f"ppl {ppl.value:+.1%} [{ppl.lo:+.1%}, {ppl.hi:+.1%}] over {ppl.n} texts")
    if drop is not None:
        out.append(f"score drop {100 * drop.value:+.1f} points [{100 * drop.lo:+.1f}, {100 * drop.hi:+.1f}] over "
                   f"{drop.n} items")
    return f"; paired: {', '.join(out)}" if out else ""


def headline(res: dict[str, list[dict[str, Any]]], arts: dict[str, Artifact]) -> list[HeadlineRow]:
    rows: list[HeadlineRow] = []

    def _rerun(names: tuple[str, ...]) -> str:
        """Why a row without an interval is undecided, and the command that writes the per-item data."""
        cmds = [arts[n].command for n in names if n in arts]
        return f"; not decided: no interval in the committed file; rerun with `{' && '.join(cmds) or 'kvstate depth eval'}`"

    def either(target: str, shown: str, parts: list[stats.Estimate | None], bars: list[float],
               names: tuple[str, ...]) -> None:
        """A target met by any of several measured signs (ppl worse by > bar, score lower by > bar), each decided on
        its paired interval: met when one is met, missed when every one is missed, undecided otherwise."""
        got = [(e, b) for e, b in zip(parts, bars, strict=True) if e is not None]
        if not got:
            add(target, shown + _rerun(names), None, names, status="undecided")
            return
        decided = [stats.decide(e.lo, e.hi, b) for e, b in got]
        status = "met" if "met" in decided else "missed" if all(d == "missed" for d in decided) else "undecided"
        pick = got[decided.index("met")] if "met" in decided else min(got, key=lambda eb: eb[0].hi - eb[1])
        ci = (pick[0].lo, pick[0].hi)
        add(target, shown, None, names, ci=ci, status=status)

    def add(target: str, measured: str, met: bool | None, names: tuple[str, ...] = (),
            ci: tuple[float, float] | None = None, status: str = "", because: str = "") -> None:
        """A row from the files of ``names``; ``because``: a property by construction (a check, not a result)."""
        used = [arts[n] for n in names if n in arts]
        if used and len(used) == len([n for n in names if n]) and because:
            rows.append(check_row(TECH, target, bool(met), because, measured, art=_worst(used)))
        elif used and len(used) == len([n for n in names if n]):
            rows.append(artifact_row(_worst(used), TECH, target, measured, met, ci=ci, status=status,
                                     rate=ci is not None))
        else:
            gone = next((n for n in names if n not in arts), RCLA)
            missing = Artifact(f"models/{gone}/{EVAL_FILE}", eval_command(gone), "missing", "file not found", None, 0)
            rows.append(artifact_row(missing, TECH, target, measured))

    def ppl_row(target: str, a: dict[str, Any], b: dict[str, Any], limit: float, names: tuple[str, ...],
                what: str) -> None:
        """A target ``ppl(a) <= (1 + limit) * ppl(b)``: paired over texts when possible."""
        est = _ppl_vs(a, b)
        if est is not None:
            add(target, f"{est.value:+.1%} [{est.lo:+.1%}, {est.hi:+.1%}] ({what}: {a['ppl']:.3f} vs {b['ppl']:.3f}, "
                f"{est.n} texts, paired)", None, names, ci=(est.lo, est.hi),
                status=stats.decide(est.lo, est.hi, limit, higher_is_better=False))
        else:
            d = a["ppl"] / b["ppl"] - 1
            add(target, f"{d:+.1%} ({what}: {a['ppl']:.3f} vs {b['ppl']:.3f}; no per-text NLL, unpaired){_rerun(names)}",
                None, names, status="undecided")

    def score_row(target: str, a: dict[str, Any], b: dict[str, Any], factor: float, names: tuple[str, ...],
                  what: str) -> None:
        """A target ``score(a) >= factor * score(b)``: paired over items when possible."""
        est = _score_vs(a, b, factor)
        shown = f"{_f3(a['score'])} vs {factor:g} x {_f3(b['score'])}"
        if a["score"] is None or b["score"] is None:
            add(target, f"{what}: {shown} (a full cache solves no cell: nothing pooled)", None, names)
        elif est is not None:
            add(target, f"{100 * est.value:+.1f} points [{100 * est.lo:+.1f}, {100 * est.hi:+.1f}] ({what}: {shown}, "
                f"n = {est.n}, paired)", None, names, ci=(est.lo, est.hi), status=stats.decide(est.lo, est.hi, 0.0))
        else:
            add(target, f"{what}: {shown} (no per-item scores, unpaired){_rerun(names)}", None, names,
                status="undecided")

    rc, ctl, spec, base, kv1 = (res.get(n) for n in (RCLA, CONTROL, SPECIALIST, BASE, KV1))
    r1, r5 = (_at(rc, keep=1.0), _at(rc, keep=0.5)) if rc else (None, None)
    k1 = _at(kv1, keep=1.0) if kv1 else None
    if r5 and k1:  # the paper's central comparison: half the KV layers vs a model trained at that KV size
        score_row("R-CLA keep 0.5 >= the equal-KV dense baseline on retrieval (paired interval not below 0)",
                  r5, k1, 1.0, (RCLA, KV1), "R-CLA keep 0.5 vs 1-KV-head model")
        ppl_row("R-CLA keep 0.5 perplexity <= the equal-KV dense baseline's (paired)", r5, k1, 0.0, (RCLA, KV1),
                "R-CLA keep 0.5 vs 1-KV-head model")
        if r5["kv_bytes_per_token"] != k1["kv_bytes_per_token"]:
            add("equal-KV baseline holds the same KV bytes per token as R-CLA at keep 0.5",
                f"{k1['kv_bytes_per_token']:g} vs {r5['kv_bytes_per_token']:g} B/token", False, (RCLA, KV1),
                because="the 1-KV-head model is configured to hold R-CLA keep 0.5's KV bytes per token")
    else:
        add("R-CLA keep 0.5 >= the equal-KV dense baseline (score and ppl, paired)", "missing eval files", None,
            (RCLA, KV1))
    if r5 and r5.get("worst_score") is not None:  # the declared family at keep 0.5: the worst pattern decides
        fam = r5.get("family_patterns") or {}
        worst = fam.get(r5["worst_pattern"], {})
        lo, hi = r5["worst_score_ci"]
        add("R-CLA keep 0.5: needle >= 0.90 on the worst pattern of its declared family",
            f"{r5['worst_score']:.3f} [{lo:.3f}, {hi:.3f}] at {r5['worst_pattern']} (mean {r5['mean_score']:.3f} over "
            f"{len(fam)} patterns, n = {len(worst.get('items', []))})", None, (RCLA,), ci=(lo, hi),
            status=stats.decide(lo, hi, 0.90))
        add("R-CLA's declared family holds >= 2 distinct keep-0.5 patterns (one fixed pattern is CLA2)",
            f"{len(fam)}: {', '.join(fam)}", len(fam) >= 2, (RCLA,),
            because="the family is every pattern the model's per-layer p declares (p_layer 1, 0.5, 1, 0.5: layers 1 "
                    "and 3 may route), not a measurement (tests/lab/depth/test_depth_family_eval.py, "
                    "tests/lab/depth/test_depth_checks.py)")
        if k1 and worst.get("items"):
            score_row("R-CLA keep 0.5 worst pattern >= the 1-KV-head model - 3 points (paired)",
                      {**r5, "score": r5["worst_score"], "items": [x + 0.03 for x in worst["items"]],
                       "all_items": [x + 0.03 for x in worst.get("all_items", [])] if "all_items" in worst else None},
                      k1, 1.0,
                      (RCLA, KV1), f"worst pattern {r5['worst_pattern']} + 0.03 vs 1-KV-head model")
        c1_ = _at(ctl, keep=1.0) if ctl else None
        if c1_:
            ppl_row("R-CLA keep 0.5 perplexity <= 1.03 x the no-routing control's keep 1 (paired)", r5, c1_, 0.03,
                    (RCLA, CONTROL), "R-CLA keep 0.5 vs control keep 1")
    elif r5:  # an evaluation from before families were scored: the worst-pattern targets are not measured
        why = "its full cache solves no cell: nothing pooled" if "worst_score" in r5 else \
            "its newest run scored no declared family (no worst_score)"
        missing = Artifact(f"models/{RCLA}/{EVAL_FILE}", eval_command(RCLA), "missing", why, None, 0)
        for target in ("R-CLA keep 0.5: needle >= 0.90 on the worst pattern of its declared family",
                       "R-CLA keep 0.5 worst pattern >= the 1-KV-head model - 3 points (paired)"):
            rows.append(artifact_row(missing, TECH, target, ""))
    if r1 and r5:
        score_row("R-CLA keep 0.5 retrieval >= 0.9 x its keep 1 (paired)", r5, r1, 0.9, (RCLA,), "keep 0.5 vs keep 1")
        ppl_row("R-CLA keep 0.5 perplexity <= 1.03 x its keep 1 (paired)", r5, r1, 0.03, (RCLA,), "keep 0.5 vs keep 1")
    else:
        add("R-CLA keep 0.5 vs keep 1.0 (0.9x score, 1.03x ppl)", f"no {RCLA}/{EVAL_FILE}", None, (RCLA,))
    c1 = _at(ctl, keep=1.0) if ctl else None
    if r1 and c1:
        # the control's own interval around its value is the band: R-CLA at keep 1 should differ from the control
        # by no more than the control's sampling noise; each difference decided on its paired interval
        ep, es = _ppl_vs(r1, c1), _score_vs(r1, c1)
        pband = (c1["ppl_ci"][0] / c1["ppl"] - 1, c1["ppl_ci"][1] / c1["ppl"] - 1)
        sband = None if c1["score"] is None or r1["score"] is None or not c1.get("score_ci") else (
            c1["score_ci"][0] - c1["score"], c1["score_ci"][1] - c1["score"])
        shown = (f"ppl {r1['ppl']:.3f} vs {c1['ppl']:.3f} [{c1['ppl_ci'][0]:.3f}, {c1['ppl_ci'][1]:.3f}]; score "
                 f"{_f3(r1['score'])} vs {_f3(c1['score'])} {c1['score_ci'] or '(nothing pooled)'}")
        target = "R-CLA keep 1 within the no-routing control's interval (ppl and score)"
        if ep is None or (sband is not None and es is None):
            add(target, shown + _rerun((RCLA, CONTROL)), None, (RCLA, CONTROL), status="undecided")
        else:
            parts: list[tuple[stats.Estimate, tuple[float, float]]] = [(ep, pband)]
            shown += (f"; paired R-CLA − control: ppl {ep.value:+.1%} [{ep.lo:+.1%}, {ep.hi:+.1%}] over {ep.n} texts "
                      f"(band {pband[0]:+.2%}, {pband[1]:+.2%})")
            if sband is not None and es is not None:
                parts.append((es, sband))
                shown += (f", score {100 * es.value:+.1f} points [{100 * es.lo:+.1f}, {100 * es.hi:+.1f}] over "
                          f"{es.n} items (band {100 * sband[0]:+.1f}, {100 * sband[1]:+.1f})")
            decided = [protocol.combine_status([stats.decide(e.lo, e.hi, band[0]),
                                                stats.decide(e.lo, e.hi, band[1], higher_is_better=False)])
                       for e, band in parts]
            status = protocol.combine_status(decided)
            pick = next((e for (e, _), d in zip(parts, decided, strict=True) if d == status), ep)
            add(target, shown, None, (RCLA, CONTROL), ci=(pick.lo, pick.hi), status=status)
    else:
        add("R-CLA keep 1 within the no-routing control's interval", "missing eval files", None, (RCLA, CONTROL))
    b1, b5 = (_at(base, keep=1.0), _at(base, keep=0.5)) if base else (None, None)
    if b1 and b5:  # worse: ppl up by > 3% or score down by > 3 points, on the paired interval
        d = b5["ppl"] / b1["ppl"] - 1
        either("post-hoc sharing of the base model measurably worse at keep <= 0.5",
               f"keep 0.5: ppl {d:+.0%} ({b5['ppl']:.1f} vs {b1['ppl']:.2f}), score {_f3(b5['score'])} vs "
               f"{_f3(b1['score'])}" + _signs(_ppl_vs(b5, b1), _score_vs(b1, b5)),
               [_ppl_vs(b5, b1), _score_vs(b1, b5)], [0.03, 0.03], (BASE,))
    else:
        add("post-hoc sharing of the base model measurably worse at keep <= 0.5", "missing eval file", None, (BASE,))
    rs, ss = (_at(rc, pattern=CLA2) if rc else None), (_at(spec, pattern=CLA2) if spec else None)
    if rs and ss:
        ppl_row(f"R-CLA within 2% ppl of the CLA2 specialist at {CLA2} (paired)", rs, ss, 0.02, (RCLA, SPECIALIST),
                f"R-CLA vs specialist at {CLA2}")
    else:
        add(f"R-CLA within 2% of the CLA2 specialist at {CLA2}", "missing eval files", None, (RCLA, SPECIALIST))
    s25 = _at(spec, keep=0.25) if spec else None
    if ss and s25:
        d = s25["ppl"] / ss["ppl"] - 1
        either("the CLA2 specialist degrades off its pattern (keep 0.25)",
               f"{s25['pattern']}: ppl {d:+.0%} ({s25['ppl']:.2f} vs {ss['ppl']:.2f}), score {_f3(s25['score'])} vs "
               f"{_f3(ss['score'])}" + _signs(_ppl_vs(s25, ss), _score_vs(ss, s25)),
               [_ppl_vs(s25, ss), _score_vs(ss, s25)], [0.03, 0.03], (SPECIALIST,))
    exact = [abs(r["kv_bytes_per_token"] - r["keep"] * _at(rows_, keep=1.0)["kv_bytes_per_token"]) < 1e-6
             for rows_ in res.values() if _at(rows_, keep=1.0) for r in rows_]
    if exact:
        add("KV bytes per token exactly proportional to kept layers (measured from cache tensors)",
            f"{sum(exact)}/{len(exact)} rows exact", all(exact), tuple(res),
            because="a sharing pattern allocates caches for its owner layers only (tests/lib/depth/"
                    "test_depth_sharing.py, tests/lab/depth/test_depth_decode.py)")
    return rows


# per model: the test seed of its newest decode run, the kept fractions and extra flags (KV1's layers were trained
# at p = 1, so its sharing patterns are measured post hoc; R-CLA's layers 0 and 2 were never routed, so keep 0.25
# is outside its family, as in its eval)
DECODE_RUNS = {RCLA: (1028, "1,0.75,0.5", ""), KV1: (1038, "1,0.75,0.5,0.25", " --post-hoc")}


def decode_command(name: str) -> str:
    """The command that regenerates ``models/<name>/depth_decode.json``."""
    seed, keeps, extra = DECODE_RUNS.get(name, (1000, "1,0.75,0.5,0.25", ""))
    return (f"kvstate depth decode --model models/{name} --keep {keeps} --context 2K --new-tokens 32 "
            f"--repeats 5 --seed {seed}{extra} --json --out models/{name}/{DECODE_FILE}")


def decode_rows(models_dir: Path) -> list[HeadlineRow]:
    """R-CLA's decode through ``model.generate`` at keep 0.5 against its keep 1 (its ``depth_decode.json``): tokens/s
    decided from the repeats' min / max (``>= 1x``; overlapping ranges: undecided), and the KV held exactly 0.5x of
    keep 1's (bytes from the cache tensors; it follows from the pattern, so a check)."""
    art = load_artifact(models_dir / RCLA / DECODE_FILE, decode_command(RCLA))
    return decode_decision(art, "R-CLA", "the pattern keeps two of four layers' caches")


REAL_DECODE = "smollm2/" + DECODE_FILE
REAL_DECODE_COMMAND = ("kvstate depth decode --model models/smollm2-135m-instruct --keep 1,0.5 --context 4K "
                       "--new-tokens 32 --repeats 5 --seed 1068 --post-hoc --json --out models/" + REAL_DECODE)


def real_decode_rows(models_dir: Path) -> list[HeadlineRow]:
    """The real model's decode at keep 0.5 against keep 1 at 4K (``models/smollm2/depth_decode.json``): the cost of a
    pattern does not depend on the weights, so the unmodified model's run stands for every fine-tune of it."""
    art = load_artifact(models_dir / REAL_DECODE, REAL_DECODE_COMMAND)
    return decode_decision(art, "Real model (SmolLM2)", "the pattern keeps 15 of 30 layers' caches")


def decode_decision(art: Any, who: str, because: str) -> list[HeadlineRow]:
    """Tokens/s at keep 0.5 over keep 1, decided from the repeats' min / max, and the KV-bytes check."""
    target = f"{who} decode through model.generate at keep 0.5: tokens/s >= keep 1's"
    if art.run is None:
        return [artifact_row(art, TECH, target, "")]
    by = {float(r["keep"]): r for r in art.run.get("results") or []}
    half, full = by.get(0.5), by.get(1.0)
    if half is None or full is None:
        return [artifact_row(art, TECH, target, "no keep 0.5 / keep 1 rows in the file", status="missing")]
    repeats = art.run.get("repeats")
    try:
        h = stats.timing_row(half["decode_tok_s"], half.get("decode_tok_s_range"), repeats, what="keep 0.5 tokens/s")
        f = stats.timing_row(full["decode_tok_s"], full.get("decode_tok_s_range"), repeats, what="keep 1 tokens/s")
    except Exception as exc:  # too few repeats or no spread: cannot decide
        rows = [artifact_row(art, TECH, target, f"not decided: {exc}", status="undecided")]
    else:
        lo, hi = h.lo / f.hi, h.hi / f.lo
        rows = [artifact_row(art, TECH, target, f"{h.value / f.value:.2f}x ({h.value:.3g} vs {f.value:.3g} tokens/s at "
                             f"{art.run.get('context')} tokens; {lo:.2f}x-{hi:.2f}x over the repeats' min / max)",
                             status=stats.decide(lo, hi, 1.0), repeats=repeats, ci=(lo, hi))]
    ratio = half["cache_bytes"] / full["cache_bytes"]
    rows.append(check_row(TECH, f"{who} at keep 0.5 holds exactly 0.5x keep 1's KV bytes through generate",
                          abs(ratio - 0.5) < 1e-9, because,
                          f"{half['cache_bytes']:,} vs {full['cache_bytes']:,} B ({ratio:.4f}x)", art=art))
    return rows


def notes(models_dir: Path) -> list[str]:
    """Facts that cannot be missed: decode speed and resident KV through ``generate`` per keep (no target)."""
    out = []
    for name in (RCLA, KV1):
        art = load_artifact(models_dir / name / DECODE_FILE, decode_command(name))
        if art.run is None:
            continue
        cells = ", ".join(f"keep {r['keep']:g}: {r['decode_tok_s']:g} tok/s ({r['decode_speedup_vs_full']}x), "
                          f"{r['cache_bytes']:,} B held" for r in art.run["results"])
        flag = "" if art.status == "current" else f" [{art.status}: regenerate with `{art.command}`]"
        out.append(f"{name} through model.generate at {art.run['context']} tokens, median of {art.run['repeats']} "
                   f"(shared 2-core machine): {cells}{flag}")
    return out


def _figure(res: dict[str, list[dict[str, Any]]], out_dir: Path, labels: dict[str, str]) -> Figure:
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for name, rows in res.items():
        if name == KV1:  # the equal-KV baseline is one point: the model at its own (halved) KV size
            rows = [r for r in rows if r["keep"] == 1.0]
        style = {"marker": "*", "markersize": 12, "linestyle": "none"} if name == KV1 else {"marker": "o"}
        for ax, key in zip(axes, ("score", "ppl"), strict=True):
            shown = [r for r in rows if r[key] is not None]  # a model whose full cache solves no cell: no score
            xs = [r["kv_bytes_per_token"] for r in shown]
            ys = [r[key] for r in shown]
            err = [[max(y - r[f"{key}_ci"][0], 0) for y, r in zip(ys, shown, strict=True)],
                   [max(r[f"{key}_ci"][1] - y, 0) for y, r in zip(ys, shown, strict=True)]] \
                if all(r.get(f"{key}_ci") for r in shown) else None
            ax.errorbar(xs, ys, yerr=err, capsize=3, color=COLORS[name], label=labels[name], **style)
    axes[0].set_ylabel("task score (needle cells the full cache solves)")
    axes[1].set_ylabel("perplexity (held-out text, 1K)")
    axes[1].set_yscale("log")
    for ax in axes:
        ax.set_xlabel("KV bytes per token (measured)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "depth_quality_vs_kv.png", dpi=100)
    plt.close(fig)
    return Figure("Quality against KV bytes per token", "depth_quality_vs_kv.png",
                  "One curve per model; points are keep 1, 0.75, 0.5, 0.25 (patterns 0_1_2_3, 0_1_2_2, 0_0_2_2, "
                  "0_0_0_0), with 95% intervals; the star is the equal-KV dense baseline (one KV head, trained at "
                  "that size). Measured by kvstate depth eval (committed depth_eval.json).")


def _pilot(models_dir: Path, out_dir: Path) -> Figure | None:
    """The pilot: the CLA2 specialist's retrieval on its training batches against tokens since models/ref-attn."""
    path = models_dir / SPECIALIST / "training_state.json"
    if not path.is_file():
        return None
    state = read_state(path, ("curve[].step", "curve[].tokens"))
    depth = state.get("depth") or {}
    curve = [c for c in state.get("curve", []) if c["step"] > depth.get("start_step", 0) and c.get("exact")]
    if not curve:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for task in ("niah_single", "niah_multikey"):
        ax.plot([(c["tokens"] - depth.get("start_tokens", 0)) / 1e6 for c in curve],
                [c["exact"].get(task, 0.0) for c in curve], label=task)
    ax.set_xlabel("tokens since models/ref-attn (millions)")
    ax.set_ylabel("exact match (rolling, training batches)")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "depth_pilot_curve.png", dpi=100)
    plt.close(fig)
    return Figure("Pilot: when retrieval returns with half the KV layers", "depth_pilot_curve.png",
                  f"The CLA2 specialist ({CLA2}) continued from models/ref-attn: exact match of the needle answers on "
                  f"its training batches (before each update) against training tokens. The budget of every depth "
                  f"comparison run is set from this curve; its held-out scores are in the table.")


PILOTS_FILE = "depth_pilots.json"  # docs/results/: dev-seed pilots (kvstate depth pilot)
PILOT_COMMAND = ("kvstate depth pilot --ckpt runs/pilots/ckpt/NAME-{1,2,3} --n 5 --seed 7 --out docs/results/"
                 f"{PILOTS_FILE}; the same with --ckpt runs/pilots/ckpt/NAME-4 --n 25")


def pilot_rows(path: Path) -> list[dict[str, Any]]:
    """One row per checkpoint of the committed pilot file (the largest ``n``, then the newest), with the run's
    ``n``; [] when absent."""
    from kvstate.lab.provenance import read_runs

    if not path.is_file():
        return []
    rows: dict[str, dict[str, Any]] = {}
    for run in read_runs(path):
        for r in run.get("rows", []):
            if r["ckpt"] not in rows or run["n"] >= rows[r["ckpt"]]["n"]:
                rows[r["ckpt"]] = {**r, "n": run["n"], "seed": run["seed"]}
    return sorted(rows.values(), key=lambda r: (r["option"], r["tokens"]))


def _pilots(path: Path, out_dir: Path) -> tuple[Figure | None, Table | None]:
    """Pilot curves (retrieval at keep 0.5 over the declared family, worst and mean, against tokens) and the table of
    each pilot's last checkpoint."""
    rows = pilot_rows(path)
    if not rows:
        return None, None
    start = [r for r in rows if r["option"] == "start"]
    options = list(dict.fromkeys(r["option"] for r in rows if r["option"] != "start"))
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for i, opt in enumerate(options):
        pts = start + [r for r in rows if r["option"] == opt]
        xs = [r["tokens"] / 1e6 for r in pts]
        for ax, (worst, mean) in zip(axes, (("worst", "mean"), ("worst_first_token", "mean_first_token")), strict=True):
            ax.plot(xs, [r[worst] for r in pts], marker="o", color=f"C{i}", label=f"{opt} (worst)")
            ax.plot(xs, [r[mean] for r in pts], marker=".", linestyle="--", color=f"C{i}", alpha=0.6, label=f"{opt} (mean)")
    axes[0].set_ylabel("exact match (teacher-forced), keep 0.5")
    axes[1].set_ylabel("first answer token right, keep 0.5")
    for ax in axes:
        ax.set_xlabel("tokens since models/ref-attn (millions)")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(out_dir / "depth_pilots.png", dpi=100)
    plt.close(fig)
    figure = Figure("Pilots: retrieval at keep 0.5 over each run's declared pattern family", "depth_pilots.png",
                    "Each pilot continues models/ref-attn on the same batches for 4 x 262,144 tokens; every checkpoint is "
                    "scored on every keep-0.5 pattern its training declares (solid: the worst pattern, dashed: the "
                    "mean) on niah_single + niah_multikey at 1K, dev seed 7, n = 5 per task on parts 1-3 and 25 on "
                    f"the last; 0 tokens is models/ref-attn under every pattern. From docs/results/{PILOTS_FILE} "
                    f"({PILOT_COMMAND}).")
    last = [max((r for r in rows if r["option"] == opt), key=lambda r: r["tokens"]) for opt in options]
    table = Table("Pilots at keep 0.5 (dev seed, last checkpoint)",
                  ["pilot", "routing", "tokens", "n/task", "patterns", "mean", "worst", "worst pattern",
                   "1st token mean", "1st token worst", "answer NLL worst"],
                  [[r["option"], _routing_cell(r.get("routing") or {}), f"{r['tokens'] / 1e6:.2f}M", r["n"],
                    len(r["patterns"]), f"{r['mean']:.3f}", f"{r['worst']:.3f}", r["worst_pattern"],
                    f"{r['mean_first_token']:.3f}", f"{r['worst_first_token']:.3f}", f"{r['worst_answer_nll']:.2f}"]
                   for r in start[-1:] + last],
                  note=f"Teacher-forced exact match (every answer token the argmax: greedy decoding would emit the "
                       f"answer). From docs/results/{PILOTS_FILE}.")
    return figure, table


def _routing_cell(d: dict[str, Any]) -> str:
    if not d:
        return "none (start model, every pattern)"
    parts = [f"p_layer {','.join(f'{v:g}' for v in d['p_layer'])}" if d.get("p_layer") else f"p {d.get('p')}"]
    if d.get("distill"):
        parts.append(f"distill {d['distill']:g}")
    if d.get("p_schedule") == "anneal":
        parts.append(f"anneal {d.get('anneal_steps')} steps")
    if d.get("retrieval_share") is not None:
        parts.append(f"needle share {d['retrieval_share']:g}")
    return ", ".join(parts)


def _trained_tokens(models_dir: Path, name: str) -> str:
    """Tokens a depth run trained since its start model (from its training_state.json), or ``—``."""
    path = models_dir / name / "training_state.json"
    if name == BASE or not path.is_file():
        return "—"
    state = read_state(path, ("tokens", "depth.start_tokens"))
    depth = state.get("depth")
    return f"{(state['tokens'] - depth['start_tokens']) / 1e6:.2f}M" if depth else "—"


def _curves(models_dir: Path, out_dir: Path) -> Figure | None:
    """Loss of each depth run on its training batches (every route drawn counts), against steps since the start."""
    fig, ax = plt.subplots(figsize=(6, 3.5))
    drawn = False
    for name in LABELS:
        path = models_dir / name / "training_state.json"
        if name == BASE or not path.is_file():
            continue
        state = read_state(path, ("curve", "curve[].step", "curve[].loss", "depth.start_step"))
        depth = state.get("depth")
        if not depth:
            continue
        curve = [c for c in state["curve"] if c["step"] > depth["start_step"]]
        ax.plot([c["step"] - depth["start_step"] for c in curve], [c["loss"] for c in curve], marker=".",
                color=COLORS[name], label=describe(models_dir, name))
        drawn = True
    if not drawn:
        plt.close(fig)
        return None
    ax.set_xlabel("steps since models/ref-attn")
    ax.set_ylabel("training loss (rolling)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "depth_learning_curves.png", dpi=100)
    plt.close(fig)
    return Figure("Learning curves of the depth runs", "depth_learning_curves.png",
                  "Answer-weighted loss on the training batches before each update, under each run's own routing "
                  "(R-CLA: a random pattern per step). models/ref-attn ended its own training near 0.6.")


def _by_cell(row: dict[str, Any], items: list[float] | None = None) -> dict[str, list[float]]:
    """A row's per-item scores split into its (task, length) cells (every cell, solved or not)."""
    cells, every = row.get("cells") or [], row.get("all_items") if items is None else items
    if not cells or not every or len(every) % len(cells):
        return {}
    per = len(every) // len(cells)
    return {c: [float(x) for x in every[i * per:(i + 1) * per]] for i, c in enumerate(cells)}


def class_floor(res: dict[str, list[dict[str, Any]]], arts: dict[str, Artifact]) -> tuple[list[HeadlineRow], Table | None]:
    """R-CLA at keep 0.5 (its headline pattern and its family's worst) per task class against its own keep 1, on
    every class keep 1 scores >= :data:`kvstate.lab.report.floor.FLOOR_AT` on: the row and the per-class table."""
    rc = res.get(RCLA) or []
    r1, r5 = _at(rc, keep=1.0), _at(rc, keep=0.5)
    if not r1 or not r5 or RCLA not in arts:
        return [], None
    ref = _by_cell(r1)
    if not ref or not _by_cell(r5):
        return [floor.floor_row(arts[RCLA], TECH, [], no_items=True)], None
    scores = floor.class_scores(f"R-CLA keep 0.5 ({r5['pattern']})", _by_cell(r5), ref, "keep 1")
    wp = r5.get("worst_pattern")
    worst = (r5.get("family_patterns") or {}).get(wp) or {}
    if wp and wp != r5["pattern"] and worst.get("all_items"):
        scores += floor.class_scores(f"R-CLA keep 0.5 ({wp}, worst of family)", _by_cell(r5, worst["all_items"]), ref,
                                     "keep 1")
    pooled = {scores[0].group: f"{_f3(r5['score'])} {r5.get('score_ci') or ''}".strip()} if scores else {}
    table = floor.floor_table(scores, "R-CLA per task class beside the pooled score: keep 0.5 against its keep 1 on "
                                      f"every class keep 1 scores >= {floor.FLOOR_AT:g} on", pooled)
    return [floor.floor_row(arts[RCLA], TECH, scores, seeds=None)], table


def build(out_dir: Path, models_dir: Path) -> Section:
    arts = load_artifacts(models_dir)
    res = {name: _rows(a) for name, a in arts.items() if a.run is not None}
    if not res:
        missing = Artifact(f"models/{RCLA}/{EVAL_FILE}", eval_command(RCLA), "missing", "file not found", None, 0)
        return Section(key="depth", title="Depth: cross-layer KV sharing and R-CLA", paper=PAPER,
                       intro=f"No {EVAL_FILE} under {models_dir}/; run kvstate depth eval --out.",
                       headline=[artifact_row(missing, TECH, "R-CLA targets", "")])
    def ci(r: dict[str, Any], key: str, fmt: str) -> str:
        lo_hi = r.get(f"{key}_ci")
        if r[key] is None:
            return "— (nothing pooled)"
        return f"{r[key]:{fmt}} [{lo_hi[0]:{fmt}}, {lo_hi[1]:{fmt}}]" if lo_hi else f"{r[key]:{fmt}}"

    def worst(r: dict[str, Any]) -> str:
        if r.get("worst_score") is None:
            return "—"
        fam = r.get("family_patterns") or {}
        return f"{r['worst_score']:.3f} ({r['worst_pattern']}; mean {r['mean_score']:.3f} of {len(fam)})"

    labels = {n: describe(models_dir, n) for n in LABELS}
    table = Table("Sharing patterns per model", ["model", "trained", "keep", "pattern", "ppl [95%]", "score [95%]",
                                                 "worst of family", "n", "KV B/token", "status"],
                  [[labels[n], _trained_tokens(models_dir, n), r["keep"], r["pattern"], ci(r, "ppl", ".3f"),
                    ci(r, "score", ".3f"), worst(r), len(r.get("items", [])), r["kv_bytes_per_token"], arts[n].status]
                   for n, rows in res.items() for r in rows],
                  note="worst of family: the lowest score over every pattern the model's training declares at that "
                       "keep (kvstate depth eval; — : a run scored before families were)")
    intro = ("Random Cross-Layer Attention trains one model so that any cross-layer KV-sharing pattern works at "
             "deployment. The 4-layer reference attention model is continued from its committed checkpoint on the "
             "same batches with R-CLA (a routed layer reads a uniformly random earlier layer — the paper's rule — "
             "with the per-layer probabilities its label gives: a layer at p = 1 is never routed), "
             "without routing (control), with the fixed CLA2 pattern (specialist), and — the paper's central "
             "comparison — as a dense model with one KV head (the same KV bytes per token as R-CLA at keep 0.5, "
             "initialised by averaging each pair of KV heads). The 'trained' column gives each run's tokens since "
             "models/ref-attn: only rows at the same budget compare fairly. Scores: exact match on niah_single / "
             "niah_multikey at 1K and 2K (the tasks the full cache solves), test seeds, 95% intervals; paired "
             f"comparisons on the same items and texts. Read from the committed {EVAL_FILE} files.")
    pilot_fig, pilot_table = _pilots(models_dir.parent / "docs" / "results" / PILOTS_FILE, out_dir)
    floor_rows, floor_table = class_floor(res, arts)
    rows = headline(res, arts)
    rc = res.get(RCLA) or []
    r5, r1 = _at(rc, keep=0.5), _at(rc, keep=1.0)
    if floor_rows and r5 and r1:  # the pooled keep-0.5 retrieval row names a collapsed class
        note = floor.collapse_note(floor.class_scores("", _by_cell(r5), _by_cell(r1), "keep 1"))
        if note:
            rows = [replace(r, measured="{}{}{}{}".format(r.measured.partition(" [stale: ")[0], note,
                                                           *r.measured.partition(" [stale: ")[1:]))
                    if r.target.startswith("R-CLA keep 0.5 retrieval") else r for r in rows]
    rcla_tables, rcla_head = rcla_section.build(models_dir)  # the real model's headline leads
    real_tables, real_head = real_section.build(models_dir)
    ft_tables, ft_figures = ft_section.build(models_dir, out_dir)  # its fine-tune pilots (dev seeds)
    intro = ("The real model first: on SmolLM2-135M-Instruct's 30 layers, R-CLA against the CLA2 specialist at the "
             "same fine-tuning budget over a declared keep-0.5 family (test seeds), the training-free cross-layer "
             "low-rank rival (xKV) at keep 0.5's bytes, and the fine-tune pilots; then the 4-layer reference "
             "models. " + intro)
    return Section(key="depth", title="Depth: cross-layer KV sharing and R-CLA", paper=PAPER, intro=intro,
                   tables=[*rcla_tables, *real_tables, *ft_tables, table, *filter(None, [floor_table, pilot_table])],
                   figures=[*ft_figures, _figure(res, out_dir, labels), *filter(None, [pilot_fig, _pilot(models_dir, out_dir),
                                                                  _curves(models_dir, out_dir)])], summary={"results": res, "artifacts": {n: {"path": a.path, "status": a.status, "reason": a.reason,
                                                                       "provenance": a.provenance} for n, a in arts.items()}},
                   headline=[*rcla_head, *real_head, *real_decode_rows(models_dir), *rows, *floor_rows, *decode_rows(models_dir)], notes=notes(models_dir))
