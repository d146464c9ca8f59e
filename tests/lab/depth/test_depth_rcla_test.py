"""The depth headline's plan: the declared family is the one the R-CLA model trains on, the targets are the issue's
(one per pattern and comparison), the per-class ratio check against a written-out computation, and the driver
scoring each method with the right model under the right pattern (tiny Llamas)."""

from __future__ import annotations

import json

import pytest
import torch

from kvstate.depth.attention import layer_specs
from kvstate.depth.patterns import LayerSpec, format_pattern
from kvstate.lab.depth import rcla_test as rt
from kvstate.models.tiny import tiny_model
from tests.lab.models.test_real_model import MODEL, needs_model

SMOL = [LayerSpec("full_attention", 3, 64)] * 30
LABELS = ["keep@0.5", "top_shared@0.5", "near1@0.5", "near2@0.5"]


def test_the_declared_family_is_the_one_the_rcla_model_trains_on():
    from kvstate.lab.depth import realtrain

    rows = rt.declared_family(SMOL)
    assert [r.label for r in rows] == LABELS
    assert all(len(r.pattern.owners) == 15 and r.kept == 0.5 for r in rows) and len({r.pattern for r in rows}) == 4
    assert format_pattern(rows[0].pattern) == "_".join(str(i - i % 2) for i in range(30))  # CLA2: the specialist's
    draws = realtrain._FamilyDraws(SMOL, seed=81)
    assert draws.patterns == [r.pattern for r in rows]
    seen = {draws() for _ in range(64)}
    assert seen == {r.pattern for r in rows}  # the training draw covers the family and nothing else


def test_the_plans_score_who_the_targets_name_with_the_issues_thresholds():
    two, four = rt.PLANS[2048], rt.PLANS[4096]
    m2 = rt.methods(two, LABELS)
    assert m2 == ("base", "rcla", *(f"rcla:{x}" for x in LABELS), *(f"cla2:{x}" for x in LABELS))
    assert rt.methods(four, LABELS) == ("base", *(f"rcla:{x}" for x in LABELS))
    t2 = rt.targets(two, LABELS)
    assert len(t2) == 8 and all(t.metric == "difference" and t.higher_is_better for t in t2)
    vs_base = [t for t in t2 if t.against == "base"]
    assert [(t.method, t.threshold) for t in vs_base] == [(f"rcla:{x}", -0.10) for x in LABELS]
    vs_cla2 = {t.method: (t.against, t.threshold) for t in t2 if t.against != "base"}
    assert vs_cla2 == {"rcla:keep@0.5": ("cla2:keep@0.5", -0.02),
                       **{f"rcla:{x}": (f"cla2:{x}", 0.10) for x in LABELS[1:]}}
    t4 = rt.targets(four, LABELS)
    assert [(t.method, t.against, t.threshold) for t in t4] == [(f"rcla:{x}", "base", -0.10) for x in LABELS]
    e = rt.experiment(two, rt.declared_family(SMOL), 1069, 100, MODEL, rt.MODELS, 48)
    assert e.methods == m2 and e.targets == t2 and e.n == 100 and e.lengths == (2048,)
    assert e.models == (str(MODEL), str(rt.MODELS["rcla"]), str(rt.MODELS["cla2"]))
    e4 = rt.experiment(four, rt.declared_family(SMOL), 1070, 100, MODEL, rt.MODELS, 48)
    assert e4.models == (str(MODEL), str(rt.MODELS["rcla"]))  # the specialist is not loaded where it is not scored


def _records(ref, a, task="niah_multikey"):
    return [{"task": task, "length": 2048, "scores": {"base": r, "rcla:keep@0.5": x}} for r, x in zip(ref, a, strict=True)]


def test_class_ratios_decide_score_against_0_9x_the_reference_per_class():
    from types import SimpleNamespace

    e = SimpleNamespace(seeds=(3,), lengths=(2048,), tasks=("niah_multikey", "niah_single"),
                        methods=("base", "rcla:keep@0.5"))
    ref = [1.0] * 60 + [0.0] * 40  # 0.6
    well = [1.0] * 55 + [0.0] * 45  # 0.55 >= 0.54 by 0.01: undecided at n = 100
    got = rt.class_ratios(e, _records(ref, well) + _records([0.0] * 100, [1.0] * 100, "niah_single"))
    assert len(got) == 1  # niah_single's reference (0.0) is below 0.5: not a class the target covers
    row = got[0]
    assert row["cell"] == "niah_multikey@2048" and row["reference"] == 0.6 and row["score"] == 0.55
    assert row["margin"] == pytest.approx(0.55 - 0.9 * 0.6) and row["ci"][0] < 0 < row["ci"][1]
    assert row["status"] == "undecided"
    assert rt.class_ratios(e, _records(ref, ref))[0]["status"] == "met"  # equal to the reference: 1 > 0.9
    assert rt.class_ratios(e, _records(ref, [0.0] * 100))[0]["status"] == "missed"
    # a perfect method on a perfect reference: the same difference (1 - 0.9) on every item, nothing to resample —
    # the discordance bound of a - ref (0 of 100 discordant) shifted by 0.1 decides it met
    perfect = rt.class_ratios(e, _records([1.0] * 100, [1.0] * 100))[0]
    assert perfect["status"] == "met" and perfect["margin"] == pytest.approx(0.1) and 0 < perfect["ci"][0] < 0.1
    lost = rt.class_ratios(e, _records([1.0] * 100, [0.0] * 100))[0]  # every item lost: constant -1
    assert lost["status"] == "missed" and lost["ci"][1] < 0
    half = [1.0, 0.0] * 50  # a reference of exactly 0.5 is a class the target covers
    assert [r["cell"] for r in rt.class_ratios(e, _records(half, half))] == ["niah_multikey@2048"]
    assert rt.class_ratios(e, _records([1.0, 0.0, 0.0, 0.0] * 25, [1.0] * 100)) == []  # 0.25: not covered


def test_missing_models_are_refused_with_the_fix(tmp_path, capsys):
    from kvstate.lab.depth import rcla_ppl

    for main, args in ((rt.main, ["--length", "4096", "--seed", "1069"]), (rcla_ppl.main, ["--seed", "1071"])):
        code = main([*args, "--base", str(tmp_path), "--rcla", str(tmp_path)])
        assert code == 2 and "holds no model" in capsys.readouterr().err
        if (MODEL / "config.json").is_file():
            code = main([*args, "--rcla", str(tmp_path)])
            assert code == 2 and "make setup" in capsys.readouterr().err


@needs_model
@torch.inference_mode()
def test_the_driver_scores_each_method_with_its_model_under_its_pattern(tmp_path):
    from kvstate.depth.sharing import apply_sharing
    from kvstate.lab.experiment import run_items
    from kvstate.lab.models.realtext_eval import score_item
    from kvstate.lab.workloads import realtext
    from kvstate.models.loading import load_tokenizer

    tok = load_tokenizer(MODEL)
    kw = {"num_hidden_layers": 8, "vocab_size": len(tok), "max_position_embeddings": 1024}
    loaded = {"base": tiny_model("llama", seed=2, **kw), "rcla": tiny_model("llama", seed=3, **kw),
              "cla2": tiny_model("llama", seed=4, **kw)}
    rows = rt.declared_family(layer_specs(loaded["rcla"].config))
    plan = rt.Plan(256, own=True, specialist=True)
    e = rt.experiment(plan, rows, 5, 2, MODEL, rt.MODELS, 8, ("niah_single",))
    out = tmp_path / "t.json"
    seen: list[str] = []

    def appendix(j):
        return {"summary": rt.summary(e, [{"task": "niah_single", "length": 256, **j.get(f"5/256/niah_single/{i}")}
                                          for i in range(2)])}

    doc = run_items(e, rt.Measure(loaded, tok, rows, e.methods, 8, seen.append), out=out, appendix=appendix)
    assert len(seen) == 2 and len(doc["decisions"]) == 8
    x = realtext.make_item(tok, "niah_single", 256, 5, 1)
    by_label = {r.label: r for r in rows}
    for name in e.methods:  # each reply is the one its model gives under its pattern
        model, _, label = name.partition(":")
        if label:
            with apply_sharing(loaded[model], by_label[label].pattern):
                _, want = score_item(loaded[model], tok, x, 8)
        else:
            _, want = score_item(loaded[model], tok, x, 8)
        assert doc["items"][1]["extra"][name]["reply"] == want["reply"][:120]
    own = doc["items"][1]["extra"]["rcla"]["reply"]  # sharing changes what the model says: the patterns are applied
    assert any(doc["items"][1]["extra"][f"rcla:{r.label}"]["reply"] != own for r in rows)
    s = json.loads(out.read_text())["runs"][-1]["appendix"]["summary"]
    assert set(s["models"]) == {"rcla", "cla2"}
    assert set(s["models"]["rcla"]["patterns"]) == {r.label for r in rows}
