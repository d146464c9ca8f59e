"""``kvstate depth train`` keeps the output rule: never into its start model, ``--resume`` only a depth run at its
own length, and a run interrupted in its first part resumes from the command line."""

from __future__ import annotations

import shutil

import pytest

import kvstate.lab.training.train as training
from kvstate.lab.depth.train import DepthTrainConfig, depth_train
from kvstate.lab.training.io import partial_dir
from kvstate.lab.training.train import load_state
from tests.bad_input_util import assert_one_line_exit_2, fingerprint, run_cli
from tests.lab.depth.conftest import FAST

SETS = [f"--set={k}={v}" for k, v in FAST.items()]


def test_the_start_model_is_never_the_output(capsys, start):
    before = fingerprint(start)
    for extra in ([], ["--overwrite"], ["--resume"]):
        assert_one_line_exit_2(run_cli(capsys, "depth", "train", "--model", start, "--out", start, "--tokens", "256",
                                       "--length", "64", *SETS, *extra), "is the input --model")
    assert fingerprint(start) == before


def test_resume_refuses_a_run_that_is_not_a_depth_run(capsys, start, tmp_path):
    out = tmp_path / "plain"
    shutil.copytree(start, out)  # a kvstate train output: no depth entry
    before = fingerprint(out)
    assert_one_line_exit_2(run_cli(capsys, "depth", "train", "--model", start, "--out", out, "--tokens", "256",
                                   "--length", "64", "--resume", *SETS), "is not a depth run")
    assert_one_line_exit_2(run_cli(capsys, "depth", "train", "--model", start, "--out", tmp_path / "none",
                                   "--tokens", "256", "--length", "64", "--resume", *SETS), "nothing to resume")
    assert fingerprint(out) == before


def test_an_interrupted_first_part_resumes_from_the_command_line(capsys, start, tmp_path, monkeypatch):
    out = tmp_path / "killed"
    real, calls = training.weighted_loss, []

    def dies_at_step_three(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(training, "weighted_loss", dies_at_step_three)
    with pytest.raises(KeyboardInterrupt):
        depth_train(start, out, DepthTrainConfig(p=0.5, length=64, tokens=6 * 256),
                    overrides={**FAST, "save_every_min": 1e-9}, progress=False, log=lambda *_: None)
    monkeypatch.setattr(training, "weighted_loss", real)
    assert not out.exists() and load_state(partial_dir(out))["step"] == 2 + 2
    assert_one_line_exit_2(run_cli(capsys, "depth", "train", "--model", start, "--out", out, "--tokens", "512",
                                   "--length", "128", "--resume", *SETS), "keeps its length", "--length 64")
    code, out_text, err = run_cli(capsys, "depth", "train", "--model", start, "--out", out, "--tokens", "512",
                                  "--length", "64", "--resume", *SETS)
    assert code == 0, err
    state = load_state(out)
    assert state["step"] == 2 + 2 + 2 and state["depth"]["start_step"] == 2 and not partial_dir(out).exists()
    assert (out / "README.md").is_file() and "saved" in out_text


def test_a_resumed_part_keeps_the_runs_evaluation_results(start, tmp_path):
    out = tmp_path / "run"
    cfg = DepthTrainConfig(p=0.5, length=64, tokens=256)
    depth_train(start, out, cfg, overrides=FAST, progress=False, log=lambda *_: None)
    (out / "depth_eval.json").write_text('{"results": [{"keep": 1.0}]}\n')
    depth_train(start, out, cfg, resume=True, overrides=FAST, progress=False, log=lambda *_: None)
    assert (out / "depth_eval.json").read_text() == '{"results": [{"keep": 1.0}]}\n'
    assert load_state(out)["step"] == 2 + 2
