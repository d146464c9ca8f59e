"""The fine-tune pilots' report part: the evaluation as a table with the paired difference to the unmodified model
and the family's worst / mean, the curves as a figure; nothing shown where no pilot ran."""

from __future__ import annotations

import json
from pathlib import Path

from kvstate.lab import experiment as X
from kvstate.lab.depth import ft_section, rcla_eval
from kvstate.lab.depth.realmodel import Posthoc
from tests.lab.depth.test_depth_rcla_eval import SMOL


def _pilot(results: Path, keep_hits: int, n: int = 10) -> None:
    rows = [Posthoc(r.label, r.family, r.keep, r.pattern, r.kept) for r in rcla_eval.family(SMOL, draws=1)]
    e = rcla_eval.experiment(Path("m"), {"rcla": Path("r")}, rows, ("niah_single",), (1024,), n, 489, 48, 0)
    e = X.Experiment(**{**e.__dict__, "code": ("lab/scoring.py",), "models": ()})

    def item(it: X.Item) -> X.ItemResult:
        got = {m: 1.0 for m in e.methods}
        got["rcla:top_shared@0.5"] = float(it.index < keep_hits)
        return X.ItemResult(got)

    def appendix(j):
        return {"summary": rcla_eval.summary(e, [{"task": "niah_single", "length": 1024,
                                                   **j.get(f"489/1024/niah_single/{i}")} for i in range(n)])}

    X.run_items(e, item, out=results / ft_section.EVAL, appendix=appendix)


def test_nothing_is_shown_without_a_pilot_and_a_pilot_reads_as_a_table_and_a_figure(models, tmp_path):
    results = models.parent / "docs" / "results"
    results.mkdir(parents=True)
    assert ft_section.build(models, tmp_path) == ([], [])
    _pilot(results, keep_hits=4)
    curve = [{"tokens": t, "prompt_kl": 3.0 / (1 + t / 1000), "reply_ce": 1.0 / (1 + t / 500)} for t in (512, 1024, 2048)]
    (results / ft_section.CURVES).write_text(json.dumps({"runs": {"rcla": {"curve": curve}, "cla2": {"curve": curve}}}))
    tables, figures = ft_section.build(models, tmp_path)
    (t,) = tables
    by = {r[0]: r for r in t.rows}
    assert by["base"][2].startswith("1.00") and by["base"][3] == ""
    assert by["rcla:top_shared@0.5"][2].startswith("0.40") and by["rcla:top_shared@0.5"][3].startswith("-0.60")
    assert "worst top_shared@0.5 0.40" in t.note and "mean 0.80" in t.note and "dev-seed pilot" in t.title
    (f,) = figures
    assert (tmp_path / f.filename).stat().st_size > 1000


def test_the_perplexity_pilot_reads_as_a_table_of_ratios(models, tmp_path):
    from kvstate.lab.depth import real_ppl

    results = models.parent / "docs" / "results"
    results.mkdir(parents=True)
    methods = ("base", "ft", "ft:keep@0.5")
    e = X.Experiment(axis="depth", name="p", methods=methods, seeds=(491,), tasks=(real_ppl.TASK,), lengths=(512,),
                     n=4, reference="base", code=("lab/scoring.py",))
    nll = {"base": 1000.0, "ft": 1010.0, "ft:keep@0.5": 1100.0}

    def item(it: X.Item) -> X.ItemResult:
        return X.ItemResult({m: 0.5 for m in methods}, {m: {"nll": v + it.index, "tokens": 511} for m, v in nll.items()})

    def appendix(j):
        return {"summary": real_ppl.summary(e, [j.get(f"491/512/heldout/{i}") for i in range(4)])}

    X.run_items(e, item, out=results / ft_section.PPL, appendix=appendix)
    tables, _ = ft_section.build(models, tmp_path)
    (t,) = tables
    by = {r[0]: r for r in t.rows}
    assert by["base"][2] == "1" and by["ft:keep@0.5"][2].startswith("1.216x")  # exp(100 / 511): 100 nats more
    assert by["ft"][2].startswith("1.020x") and "1.05x" in t.note
