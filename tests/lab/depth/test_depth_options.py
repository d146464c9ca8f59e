"""depth train's retrieval options on a tiny start model (recorded, in effect, refused on resume when changed,
bad input), and the dev-seed own-K/V diagnosis."""

from __future__ import annotations

import json

import pytest

from kvstate.depth.patterns import LayerSpec, PatternError
from kvstate.errors import KVStateError
from kvstate.lab.depth.train import DepthTrainConfig, depth_train, retrieval_mix
from kvstate.lab.training.config import TASK_MIX
from kvstate.lab.training.train import load_state
from tests.lab.depth.conftest import FAST

QUIET = {"progress": False, "log": lambda *_: None}


def test_options_are_recorded_and_take_effect(start, tmp_path):
    out = tmp_path / "opts"
    cfg = DepthTrainConfig(length=64, tokens=8 * 256, p_layer=(1, 1, 0.5, 0), distill=1.0, p_schedule="anneal",
                           anneal_frac=0.5, retrieval_share=0.9)
    state = depth_train(start, out, cfg, overrides={**FAST, "log_every": 1}, **QUIET)
    depth = load_state(out)["depth"]
    assert depth["p"] is None and depth["p_layer"] == [1, 1, 0.5, 0] and depth["distill"] == 1.0
    assert depth["p_schedule"] == "anneal" and depth["anneal_frac"] == 0.5 and depth["anneal_steps"] == 4
    assert depth["retrieval_share"] == 0.9
    # the family: layers 0 and 1 always own, layer 3 (p = 0) never; keep 0.5 has four patterns
    assert depth["family"]["always_own"] == [0, 1] and depth["family"]["by_keep"]["0.5"] == ["0_1_0_0", "0_1_0_1", "0_1_1_0", "0_1_1_1"]
    counts = depth["parts"][0]["draw_counts"]
    assert sum(counts.values()) == 8 and all(r.split("_")[1] == "1" for r in counts)  # layer 1 never routed
    assert "0_1_2_3" in counts  # step 0 of the anneal draws p = 1 everywhere
    # distillation: a KL term in the curve, zero on the steps whose route kept every layer, positive otherwise
    aux = [c["aux"] for c in state["curve"] if c["step"] > 2]
    assert len(aux) == 8 and aux[0] == 0.0 and max(aux) > 0
    # the mix: needle tasks are 0.9 of the rows, the rest keep their proportions
    mix = load_state(out)["config"]["task_mix"]
    needle = sum(v for t, v in mix.items() if t.startswith("niah_"))
    assert abs(needle / sum(mix.values()) - 0.9) < 1e-6 and abs(mix["copy"] / mix["text"] - 12.0) < 1e-6
    # a resumed part must keep every option
    for field, value in (("distill", 0.5), ("p_layer", (1, 0.5, 0.5, 0)), ("retrieval_share", None)):
        other = DepthTrainConfig(**{**{k: getattr(cfg, k) for k in ("length", "p_layer", "distill", "p_schedule",
                                                                     "anneal_frac", "retrieval_share")},
                                    "tokens": 256, field: value})
        with pytest.raises(KVStateError, match=f"{field}="):
            depth_train(start, out, other, resume=True, overrides=FAST, **QUIET)
    again = depth_train(start, out, DepthTrainConfig(**{**cfg.__dict__, "tokens": 2 * 256}), resume=True,
                        overrides=FAST, **QUIET)
    assert again["depth"]["anneal_steps"] == 4 and len(again["depth"]["parts"]) == 2


def test_anneal_tokens_span_a_run_trained_in_parts(start, tmp_path):
    from kvstate.lab.depth.train import anneal_horizon

    out = tmp_path / "anneal"
    cfg = DepthTrainConfig(p=0.0, length=64, tokens=2 * 256, p_schedule="anneal", anneal_tokens=4 * 256)
    assert anneal_horizon(cfg, 2, 256) == 4  # the horizon is the tokens given, not a share of this part's 2 steps
    assert anneal_horizon(DepthTrainConfig(p=0.0, tokens=2 * 256, p_schedule="anneal", anneal_frac=0.5), 2, 256) == 1
    first = depth_train(start, out, cfg, overrides=FAST, **QUIET)
    assert first["depth"]["anneal_steps"] == 4 and first["depth"]["anneal_tokens"] == 1024
    assert first["depth"]["anneal_frac"] is None
    assert first["depth"]["parts"][0]["draw_counts"] == {"0_1_2_3": 1, **first["depth"]["parts"][0]["draw_counts"]}
    again = depth_train(start, out, cfg, resume=True, overrides=FAST, **QUIET)
    assert again["depth"]["anneal_steps"] == 4 and len(again["depth"]["parts"]) == 2
    # p = 0 after the anneal: every step from the 4th on routes all layers but the first; the schedule continued
    routing = load_state(out)["context_state"][0]
    assert routing["draws"] == 4 and routing["anneal_steps"] == 4
    with pytest.raises(KVStateError, match="anneal_tokens="):
        depth_train(start, out, DepthTrainConfig(**{**cfg.__dict__, "anneal_tokens": 8 * 256}), resume=True,
                    overrides=FAST, **QUIET)
    with pytest.raises(KVStateError, match="--anneal-tokens sets the anneal's horizon"):
        DepthTrainConfig(tokens=10, anneal_tokens=100)


def test_no_options_record_the_defaults(start, tmp_path):
    state = depth_train(start, tmp_path / "plain", DepthTrainConfig(p=0.5, length=64, tokens=256), overrides=FAST,
                        **QUIET)
    d = state["depth"]
    assert (d["p"], d["p_layer"], d["distill"], d["p_schedule"], d["anneal_steps"], d["retrieval_share"]) == (
        0.5, None, 0.0, "constant", 0, None)
    assert d["family"]["patterns"] == 15 and all("aux" not in c for c in state["curve"])


def test_retrieval_mix():
    mix = retrieval_mix(TASK_MIX, 0.5)
    needle = sum(v for t, v in mix.items() if t.startswith("niah_"))
    assert abs(needle / sum(mix.values()) - 0.5) < 1e-6
    assert abs(mix["niah_drill"] / mix["niah_single"] - 4.0) < 1e-6


@pytest.mark.parametrize("args,message", [
    (["--p-layer", "1,1,0.5"], "--p-layer has 3 entries but the model has 4 layers"),
    (["--p-layer", "1,1,0.5,1.5"], "--p-layer entry 3 (layer 3) is 1.5; each must be a number in [0, 1]"),
    (["--p-layer", "1,a,0.5,1"], "--p-layer '1,a,0.5,1' must be comma-separated numbers"),
    (["--distill", "-0.5"], "--distill -0.5 must be a weight >= 0"),
    (["--p-schedule", "cosine"], "--p-schedule 'cosine' is unknown; choose one of constant, anneal"),
    (["--retrieval-share", "1.5"], "--retrieval-share"),
])
def test_cli_bad_input_is_one_line_and_exit_2(start, tmp_path, capsys, args, message):
    from kvstate.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["depth", "train", "--model", str(start), "--out", str(tmp_path / "bad"), "--tokens", "256",
              "--length", "64", *args])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "bad").exists()


def test_config_bad_input():
    with pytest.raises(PatternError, match="entry 1"):
        DepthTrainConfig(tokens=10, p_layer=(1, -0.1))
    with pytest.raises(KVStateError, match="--distill"):
        DepthTrainConfig(tokens=10, distill=-1)
    with pytest.raises(KVStateError, match="--p-schedule anneal counts steps: pass --tokens"):
        DepthTrainConfig(minutes=1, p_schedule="anneal")
    with pytest.raises(KVStateError, match="--pattern trains one fixed pattern"):
        DepthTrainConfig(tokens=10, pattern="0_0_2_2", distill=1)


def test_diagnosis_ablates_each_layer_and_refuses_test_seeds(start, tmp_path):
    from kvstate.lab.depth.diagnose import ablations, check_out, diagnose

    F = LayerSpec("full_attention", 2, 16)
    got = [(layer, src) for layer, src, _ in ablations([F] * 4)]
    assert got == [(None, None), (1, 0), (2, 1), (2, 0), (3, 2), (3, 0)]
    res = diagnose(start, n=2, seed=3, lengths=[256])
    assert [r["pattern"] for r in res["rows"]] == ["0_1_2_3", "0_0_2_3", "0_1_1_3", "0_1_0_3", "0_1_2_2", "0_1_2_0"]
    for r in res["rows"]:
        for t in ("niah_single", "niah_multikey"):
            cell = r["tasks"][t]
            assert len(cell["items"]) == 2 and cell["ci"][0] <= cell["score"] <= cell["ci"][1]
    json.dumps(res)
    with pytest.raises(KVStateError, match="test seed"):
        diagnose(start, n=1, seed=1000)
    with pytest.raises(KVStateError, match="under models/"):
        check_out(tmp_path / "models" / "x.json")
