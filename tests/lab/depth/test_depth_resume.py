"""A resumed depth run continues the unbroken one: same routing draws, same warm-up, same weights; a resume with
other routing settings is refused; kvstate train keeps restarting warm-up per part by default."""

from __future__ import annotations

import json

import pytest
import torch

import kvstate.lab.training.train as training
from kvstate.errors import KVStateError
from kvstate.lab.depth.train import DepthTrainConfig, depth_train
from kvstate.lab.training.io import STATE_FILE, partial_dir
from kvstate.lab.training.train import CONTEXT_KEY, TrainConfig, load_state, train
from kvstate.models.loading import load_model
from tests.lab.depth.conftest import FAST, SMALL

WARM = {**FAST, "warmup_steps": 6}  # a split inside the warm-up shows whether a part restarts it
QUIET = {"progress": False, "log": lambda *_: None}


def _run(start, out, steps, resume=False, **cfg):
    return depth_train(start, out, DepthTrainConfig(**{"p": 0.5, "length": 64, "tokens": steps * 256, **cfg}),
                       resume=resume, overrides=WARM, **QUIET)


def _weights(path):
    return load_model(path, torch.float32).state_dict()


def _same_weights(a, b):
    wa, wb = _weights(a), _weights(b)
    return wa.keys() == wb.keys() and all(torch.allclose(wa[k], wb[k], atol=1e-6) for k in wa)


@pytest.fixture(scope="module")
def unbroken(start, tmp_path_factory):
    out = tmp_path_factory.mktemp("unbroken") / "run"
    _run(start, out, 8)
    return out


def test_a_resumed_run_continues_the_draws_and_the_warm_up(start, unbroken, tmp_path):
    out = tmp_path / "split"
    _run(start, out, 3)
    resumed = _run(start, out, 5, resume=True)
    whole = load_state(unbroken)
    assert resumed["step"] == whole["step"] == 2 + 8
    assert resumed[CONTEXT_KEY] == whole[CONTEXT_KEY] and whole[CONTEXT_KEY][0]["draws"] == 8
    assert resumed["warmup_start"] == whole["warmup_start"] == 2  # the run's first step, not the part's
    parts = [p["draw_counts"] for p in resumed["depth"]["parts"]]
    assert len(parts) == 2 and sum(sum(c.values()) for c in parts) == 8
    merged = {k: sum(c.get(k, 0) for c in parts) for k in {*parts[0], *parts[1]}}
    assert merged == whole["depth"]["parts"][0]["draw_counts"]
    assert _same_weights(out, unbroken)


def test_a_part_that_restarts_warm_up_and_draws_diverges(start, unbroken, tmp_path):
    """The check above can fail: per-part warm-up (the old behaviour) and fresh draws give other weights."""
    out = tmp_path / "old"
    _run(start, out, 3)
    state = json.loads((out / STATE_FILE).read_text())
    del state[CONTEXT_KEY]  # as a run saved before routing state existed
    (out / STATE_FILE).write_text(json.dumps(state))
    (out / "manifest.json").unlink()
    depth_train(start, out, DepthTrainConfig(p=0.5, length=64, tokens=5 * 256), resume=True,
                overrides={**WARM, "warmup_per_part": True}, **QUIET)
    assert load_state(out)["warmup_start"] == 5 and not _same_weights(out, unbroken)


def test_an_interrupted_part_resumes_from_its_periodic_saves(start, unbroken, tmp_path, monkeypatch):
    out = tmp_path / "killed"
    real, calls = training.weighted_loss, []

    def dies_at_step_five(*args, **kwargs):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(training, "weighted_loss", dies_at_step_five)
    with pytest.raises(KeyboardInterrupt):
        depth_train(start, out, DepthTrainConfig(p=0.5, length=64, tokens=8 * 256), resume=False,
                    overrides={**WARM, "save_every_min": 1e-9}, **QUIET)
    monkeypatch.setattr(training, "weighted_loss", real)
    saved = load_state(partial_dir(out))
    assert not out.exists() and saved["step"] == 2 + 4 and saved[CONTEXT_KEY][0]["draws"] == 4
    resumed = _run(start, out, 4, resume=True)
    assert resumed["step"] == 10 and resumed[CONTEXT_KEY] == load_state(unbroken)[CONTEXT_KEY]
    assert not partial_dir(out).exists() and _same_weights(out, unbroken)


@pytest.mark.parametrize(("change", "words"), [({"p": 0.75}, "p=0.5"), ({"seed": 1}, "seed=0"),
                                               ({"rule": "owner"}, "rule='paper'"),
                                               ({"pattern": "0_0_2_2"}, "pattern=None")])
def test_a_resume_with_other_routing_settings_is_refused(start, unbroken, tmp_path, change, words):
    with pytest.raises(KVStateError, match=rf"was trained with .*{words}.*a resumed run must keep its routing"):
        _run(start, unbroken, 1, resume=True, **change)
    assert load_state(unbroken)["step"] == 10  # nothing was trained


def test_a_run_recorded_before_the_rule_existed_resumes_only_with_the_owner_rule(start, tmp_path):
    out = tmp_path / "legacy"
    _run(start, out, 2, rule="owner")
    state = json.loads((out / STATE_FILE).read_text())
    del state["depth"]["rule"]
    (out / STATE_FILE).write_text(json.dumps(state))
    (out / "manifest.json").unlink()
    with pytest.raises(KVStateError, match="--rule owner"):
        _run(start, out, 1, resume=True)
    assert _run(start, out, 1, resume=True, rule="owner")["depth"]["rule"] == "owner"


def test_kvstate_train_warms_up_per_part_unless_told_otherwise(tmp_path):
    out = tmp_path / "ref"
    cfg = TrainConfig(minutes=5, max_steps=2, **SMALL)
    train(cfg, out, **QUIET)
    assert train(cfg, out, resume=out, **QUIET)["warmup_start"] == 2  # the old default: every part warms up
    once = TrainConfig(minutes=5, max_steps=2, warmup_per_part=False, **SMALL)
    assert train(once, out, resume=out, **QUIET)["warmup_start"] == 2  # this part started the schedule
    assert train(once, out, resume=out, **QUIET)["warmup_start"] == 2 and load_state(out)["step"] == 8
    with pytest.raises(KVStateError, match="warmup_per_part"):
        TrainConfig(warmup_per_part="no")
