"""kvstate depth eval over the declared pattern family: every pattern at a keep scored, the mean and the worst;
a pattern outside the family refused at eval and deployment with the layer it breaks."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest

from kvstate.depth.patterns import LayerSpec, PatternError, format_pattern
from kvstate.lab.depth import evaluate
from kvstate.lab.depth.evaluate import evaluate_sharing, family_plan

F = LayerSpec("full_attention", 2, 16)
LAYERS = [F] * 4


def test_worst_pattern_on_a_constructed_eval(start, monkeypatch):
    # pattern -> per-item scores: 0_1_0_0 is the worst (0 of 4), 0_0_2_0 next (1 of 4), the rest solve every item
    constructed = {"0_1_0_0": [0, 0, 0, 0], "0_0_2_0": [1, 0, 0, 0]}

    cells = [(t, n) for t in evaluate.SCORE_TASKS for n in evaluate.SCORE_LENGTHS]  # (task, length) order

    def fake_score(model, tokenizer, pattern, tasks, lengths, n, seed, progress):
        assert len(tasks) == len(lengths) == n == 1  # the experiment loop measures one cell at a time
        items = constructed.get(format_pattern(pattern), [1, 1, 1, 1])
        v = items[cells.index((tasks[0], lengths[0]))]
        return SimpleNamespace(examples=[SimpleNamespace(score=v, cache_bytes=64, n_tokens=8, decode_s=0.1,
                                                         new_tokens=2)])

    monkeypatch.setattr(evaluate, "_score", fake_score)
    res = evaluate_sharing(start, [1, 0.5], n=1, seed=0, ppl_length=128, ppl_texts=2, depth={"p": 0.5, "p_layer": None})
    full, half = res["results"]
    assert full["family"] == "declared" and list(full["family_patterns"]) == ["0_1_2_3"] and full["worst_score"] == 1.0
    assert half["pattern"] == "0_0_2_2" and next(iter(half["family_patterns"])) == "0_0_2_2"
    assert sorted(half["family_patterns"]) == ["0_0_0_3", "0_0_2_0", "0_0_2_2", "0_1_0_0", "0_1_0_1", "0_1_1_0",
                                              "0_1_1_1"]
    assert half["worst_pattern"] == "0_1_0_0" and half["worst_score"] == 0.0 and half["score"] == 1.0
    assert half["worst_score_ci"][0] == 0.0 < half["worst_score_ci"][1]  # an interval with width at 0 of 4
    assert abs(half["mean_score"] - (5 + 0.25) / 7) < 1e-3
    assert half["family_patterns"]["0_0_2_0"]["items"] == [1.0, 0.0, 0.0, 0.0]
    json.dumps(res)


def test_family_plan_refuses_patterns_outside_the_family():
    p_layer = {"p": None, "p_layer": [1, 0.5, 1, 0.5]}
    head, pats, how = family_plan(p_layer, LAYERS, 0.5)
    assert how == "declared" and format_pattern(head) == "0_0_2_2" and [format_pattern(p) for p in pats] == [
        "0_0_2_2", "0_0_2_0"]
    with pytest.raises(PatternError, match=r"layer 2 was trained at p = 1 .* or pass --post-hoc"):
        family_plan(p_layer, LAYERS, 0.25)  # keep 0.25 is 0_0_0_0: layer 2 would read layer 0
    with pytest.raises(PatternError, match="layer 1 reads layer 1 but the model was trained on the fixed pattern "
                                           "'0_0_2_2' only"):
        family_plan({"pattern": "0_0_2_2"}, LAYERS, 1.0)
    head, pats, how = family_plan({"pattern": "0_0_2_2"}, LAYERS, 1.0, post_hoc=True)
    assert how == "post hoc" and pats == [head]
    assert family_plan(None, LAYERS, 0.25)[2] == "undeclared"
    assert family_plan({"p": 1.0, "p_layer": None}, LAYERS, 0.5, post_hoc=True)[2] == "post hoc"  # the control


@pytest.mark.parametrize("command", ["eval", "decode"])
def test_cli_refuses_an_out_of_family_pattern_in_one_line(start, tmp_path, capsys, command):
    from kvstate.cli import main
    from kvstate.integrity import MANIFEST

    model = tmp_path / "fixed"
    shutil.copytree(start, model)
    (model / MANIFEST).unlink(missing_ok=True)
    state = json.loads((model / "training_state.json").read_text())
    state["depth"] = {"pattern": "0_0_2_2", "p": None}
    (model / "training_state.json").write_text(json.dumps(state))
    with pytest.raises(SystemExit) as exc:
        main(["depth", command, "--model", str(model), "--keep", "0.5,1"])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1, err
    assert "layer 1 reads layer 1 but the model was trained on the fixed pattern '0_0_2_2'" in err


def test_report_decides_the_worst_pattern_targets():
    from kvstate.lab.depth.section import CONTROL, KV1, RCLA, headline
    from kvstate.lab.provenance import Artifact

    def row(keep, pattern, items, ppl=10.0, **extra):
        n = len(items)
        return {"keep": keep, "pattern": pattern, "ppl": ppl, "ppl_ci": [ppl - 0.1, ppl + 0.1],
                "score": sum(items) / n, "score_ci": [0.0, 1.0], "kv_bytes_per_token": 4096 * keep, "items": items,
                "text_nll": [[ppl, 100]] * 4, **extra}

    good, bad = [1.0] * 100, [1.0] * 50 + [0.0] * 50
    fam = {"0_0_2_2": {"score": 1.0, "items": good}, "0_0_2_0": {"score": 0.5, "items": bad}}
    r5 = row(0.5, "0_0_2_2", good, family_patterns=fam, mean_score=0.75, worst_score=0.5,
             worst_score_ci=[0.4, 0.6], worst_pattern="0_0_2_0")
    res = {RCLA: [row(1.0, "0_1_2_3", good), r5], KV1: [row(1.0, "0_1_2_3", good)],
           CONTROL: [row(1.0, "0_1_2_3", good)]}
    arts = {n: Artifact(f"models/{n}/depth_eval.json", "cmd", "current", "", {"results": rows}, 1)
            for n, rows in res.items()}
    rows = {h.target: h for h in headline(res, arts)}
    worst = rows["R-CLA keep 0.5: needle >= 0.90 on the worst pattern of its declared family"]
    assert worst.status == "missed" and "0_0_2_0" in worst.measured  # [0.4, 0.6] lies below 0.90
    family = rows["R-CLA's declared family holds >= 2 distinct keep-0.5 patterns (one fixed pattern is CLA2)"]
    assert family.met and family.kind == "check"  # follows from the declared p_layer: a check, not a result
    paired = rows["R-CLA keep 0.5 worst pattern >= the 1-KV-head model - 3 points (paired)"]
    assert paired.status == "missed" and "-47.0 points" in paired.measured  # 0.5 + 0.03 - 1.0, paired
    assert "R-CLA keep 0.5 perplexity <= 1.03 x the no-routing control's keep 1 (paired)" in rows
    # rows of another test seed are other items: never paired
    res[KV1] = [{**res[KV1][0], "seed": 1000}]
    res[RCLA] = [{**r, "seed": 1005} for r in res[RCLA]]
    rows = {h.target: h for h in headline(res, arts)}
    assert "unpaired" in rows["R-CLA keep 0.5 worst pattern >= the 1-KV-head model - 3 points (paired)"].measured


def test_report_decides_decode_speed_from_the_repeats_and_checks_the_bytes_held(tmp_path):
    from kvstate.lab.depth.section import DECODE_FILE, RCLA, decode_rows
    from kvstate.lab.provenance import Recorder, append_run

    def write(half_range, half_bytes=4096):
        path = tmp_path / f"m{half_range[0]:g}-{half_bytes}" / RCLA / DECODE_FILE
        path.parent.mkdir(parents=True)
        rows = [{"keep": 1.0, "decode_tok_s": 200.0, "decode_tok_s_range": [190.0, 210.0], "cache_bytes": 8192},
                {"keep": 0.5, "decode_tok_s": sum(half_range) / 2, "decode_tok_s_range": half_range,
                 "cache_bytes": half_bytes}]
        append_run(path, {"context": 2048, "repeats": 5, "results": rows},
                   Recorder(code=("lab/depth/section.py",), seeds=[1005]).finish())
        return path.parent.parent

    speed, held = decode_rows(write([240.0, 260.0]))
    assert speed.status == "met" and "1.25x" in speed.measured and held.kind == "check" and held.met is True
    assert decode_rows(write([180.0, 230.0]))[0].status == "undecided"  # the ranges overlap
    assert decode_rows(write([150.0, 170.0]))[0].status == "missed"
    assert decode_rows(write([240.0, 260.0], half_bytes=4100))[1].met is False  # not exactly half: the check fails


def test_two_models_pair_on_the_cells_both_full_caches_solve():
    from kvstate.lab.depth.section import _score_vs

    cells = ["niah_single@1024", "niah_multikey@1024"]
    # a's full cache solves both cells, b's only the first: the pair is on the first cell's 4 items only
    a = {"seed": 1000, "score": 0.75, "items": [1, 1, 1, 0, 1, 0, 1, 1], "tasks": cells, "cells": cells,
         "all_items": [1, 1, 1, 0, 1, 0, 1, 1]}
    b = {"seed": 1000, "score": 0.5, "items": [1, 0, 1, 0], "tasks": cells[:1], "cells": cells,
         "all_items": [1, 0, 1, 0, 0, 0, 0, 0]}
    est = _score_vs(a, b)
    assert est.n == 4 and abs(est.value - 0.25) < 1e-12  # (3 - 2) / 4 on niah_single only
    assert _score_vs(a, {**b, "seed": 1001}) is None  # other items: never paired


def test_a_model_whose_full_cache_solves_no_cell_decides_nothing():
    from kvstate.lab.depth.section import BASE, headline
    from kvstate.lab.provenance import Artifact

    def row(keep, pattern, ppl):
        return {"keep": keep, "pattern": pattern, "ppl": ppl, "ppl_ci": [ppl * 0.9, ppl * 1.1], "score": None,
                "score_ci": None, "items": [], "tasks": [], "excluded_tasks": {"niah_single@1024": 0.5},
                "kv_bytes_per_token": 256 * keep, "seed": 1000}

    res = {BASE: [row(1.0, "0_1_2_3", 10.0), row(0.5, "0_0_2_2", 10.1)]}
    arts = {BASE: Artifact("models/x/depth_eval.json", "cmd", "current", "", {}, 1)}
    rows = {h.target: h for h in headline(res, arts)}
    r = rows["post-hoc sharing of the base model measurably worse at keep <= 0.5"]
    # ppl +1% only, with no per-text NLL to give it an interval, and no score to compare: undecided, naming the rerun
    assert "score — vs —" in r.measured and r.status == "undecided" and r.met is None and "rerun with `cmd`" in r.measured
