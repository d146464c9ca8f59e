"""The pilot evaluation: teacher-forced exact match against greedy decoding through the sharing cache (the
oracle), every pattern of the declared family scored with its worst, dev seeds only."""

from __future__ import annotations

import json

import pytest

from kvstate.depth.patterns import LayerSpec, parse_pattern
from kvstate.errors import KVStateError
from kvstate.lab.depth.pilot import run_family, score_checkpoint, teacher_forced_ids

F = LayerSpec("full_attention", 2, 16)


def test_teacher_forced_matches_greedy_through_the_sharing_cache(start):
    from kvstate.depth.sharing import apply_sharing, sharing_cache
    from kvstate.lab.harness import greedy_answer, load_reference
    from kvstate.lab.workloads.tasks import generate

    model, tok = load_reference(start)
    model.eval()
    pattern = parse_pattern("0_0_2_0")
    checked = 0
    for ex in generate("niah_single", 128, 3, 7, tok):
        prompt = tok(ex.prompt)["input_ids"]
        with apply_sharing(model, pattern):
            _, _, _, dec, _ = greedy_answer(model, tok, ex.prompt, sharing_cache(model.config, pattern), 5)
            greedy = list(dec.tokens)
            if len(greedy) < 2:
                continue
            along = teacher_forced_ids(model, prompt, greedy)  # the greedy path is the argmax path: exact
            wrong = teacher_forced_ids(model, prompt, [*greedy[:-1], (greedy[-1] + 1) % model.config.vocab_size])
        assert along["exact"] == 1.0 and along["pred"] == greedy and along["first"] == 1.0
        assert wrong["exact"] == 0.0 and wrong["pred"][:-1] == greedy[:-1] and wrong["nll"] > along["nll"]
        checked += 1
    assert checked >= 1


def test_family_per_run_kind():
    layers = [F] * 4
    uniform, how = run_family(None, layers, 0.5)
    assert how == "uniform" and len(uniform) == 7
    declared, how = run_family({"p": None, "p_layer": [1, 0.5, 1, 0.5]}, layers, 0.5)
    assert how == "declared" and sorted(p.sources for p in declared) == [(0, 0, 2, 0), (0, 0, 2, 2)]
    fixed, how = run_family({"pattern": "0_0_2_2"}, layers, 0.5)
    assert how == "fixed" and [p.sources for p in fixed] == [(0, 0, 2, 2)]
    assert run_family({"pattern": "0_0_2_2"}, layers, 0.25)[0] == []


def test_score_checkpoint_scores_every_pattern_and_the_worst(start):
    res = score_checkpoint(start, n=2, seed=7, lengths=[128])
    assert res["family"] == "uniform" and len(res["patterns"]) == 7 and res["tokens"] == 0
    scores = {k: v["score"] for k, v in res["patterns"].items()}
    assert res["worst"] == min(scores.values()) and scores[res["worst_pattern"]] == res["worst"]
    assert abs(res["mean"] - sum(scores.values()) / 7) < 1e-3
    assert all(len(v["items"]) == 4 for v in res["patterns"].values())
    json.dumps(res)
    with pytest.raises(KVStateError, match="test seed"):
        score_checkpoint(start, n=1, seed=1000)


def test_pilot_cli_refuses_models_dir_and_test_seed(start, tmp_path, capsys):
    from kvstate.cli import main

    for args, message in ((["--out", str(tmp_path / "models" / "p.json")], "under models/"),
                          (["--out", str(tmp_path / "p.json"), "--seed", "1001"], "is a test seed")):
        with pytest.raises(SystemExit) as exc:
            main(["depth", "pilot", "--ckpt", str(start), *args])
        err = capsys.readouterr().err.strip()
        assert exc.value.code == 2 and message in err and len(err.splitlines()) == 1, err
