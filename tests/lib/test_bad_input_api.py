"""Bad input through the Python API: loading checks, checksum manifests, whole-or-nothing outputs, training
that refuses to overwrite and stops on non-finite values, duplicate tasks, impossible configs."""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest
import torch
import transformers as tf
from safetensors.torch import load_file, save_file

from kvstate.errors import IntegrityError, ModelConfigError, ModelLoadError, OutputError
from kvstate.integrity import check_safetensors_header, verify_manifest, write_manifest
from kvstate.io_safety import check_output_dir, staged_dir, write_text_atomic
from kvstate.lab.harness import check_lengths_fit, check_tasks
from kvstate.lab.training import train as train_mod
from kvstate.lab.training.io import partial_dir, save_run
from kvstate.lab.training.train import TrainConfig, TrainError, train
from kvstate.lab.workloads import build_tokenizer
from kvstate.models import describe, load_model, tiny_config
from tests.bad_input_util import TINY, fingerprint, trained_model
from tests.conftest import get_model


@pytest.fixture
def trained(tmp_path_factory) -> Path:
    return trained_model(tmp_path_factory)



def _run(out: Path, **kw) -> dict:  # type: ignore[no-untyped-def]
    return train(TrainConfig(arch="attn", **TINY), out, progress=False, log=lambda s: None, **kw)



def _modes(root: Path) -> set[int]:
    return {stat.S_IMODE(p.stat().st_mode) for p in root.iterdir() if p.is_file()}


def test_training_output_is_whole_checksummed_and_0644(trained):
    assert (trained / "manifest.json").is_file() and verify_manifest(trained, required=True)
    mask = os.umask(0)
    os.umask(mask)
    assert _modes(trained) == {0o666 & ~mask} and stat.S_IMODE(trained.stat().st_mode) == 0o777 & ~mask
    assert not partial_dir(trained).exists()
    assert not [p for p in trained.parent.iterdir() if p.name.startswith(".")]  # no temporary siblings left


def test_train_refuses_existing_output_and_overwrite_replaces_it_whole(tmp_path, trained):
    out = tmp_path / "m"
    shutil.copytree(trained, out)
    (out / "README.md").write_text("card of another model")
    before = fingerprint(tmp_path)
    with pytest.raises(OutputError, match="--overwrite"):
        _run(out)
    assert fingerprint(tmp_path) == before
    _run(out, overwrite=True)
    assert not (out / "README.md").exists() and verify_manifest(out, required=True)  # no stale card beside it


def test_resume_into_its_own_directory_needs_no_overwrite(tmp_path, trained):
    out = tmp_path / "m"
    shutil.copytree(trained, out)
    state = _run(out, resume=out)
    assert state["step"] == 2 and json.loads((out / "training_state.json").read_text())["step"] == 2


def test_a_diverging_run_stops_and_saves_nothing(tmp_path, trained, monkeypatch):
    out = tmp_path / "m"
    shutil.copytree(trained, out)
    before = fingerprint(tmp_path)
    real = train_mod.weighted_loss
    monkeypatch.setattr(train_mod, "weighted_loss", lambda *a: real(*a) * float("nan"))
    with pytest.raises(TrainError, match=r"diverged at step 0.*nothing of this run was saved"):
        _run(out, overwrite=True)
    assert fingerprint(tmp_path) == before


def test_non_finite_weights_are_never_saved(tmp_path):
    model = get_model("qwen3")
    bad = type(model)(model.config)
    with torch.no_grad():
        next(bad.parameters()).fill_(float("inf"))
    opt = torch.optim.AdamW(bad.parameters())
    with pytest.raises(TrainError, match="NaN or inf"):
        save_run(bad, build_tokenizer(), opt, tmp_path / "out", {})
    assert list(tmp_path.iterdir()) == []


def test_unwritable_outputs_are_found_before_work(tmp_path):
    (tmp_path / "file").write_text("x")
    for bad in (tmp_path / "file", tmp_path / "file" / "sub", Path("/proc/kvstate-x/y")):
        with pytest.raises(OutputError):
            check_output_dir(bad)
    for cwd_or_above in (Path("."), Path(".."), Path.cwd()):  # --overwrite must never replace the working dir
        with pytest.raises(OutputError, match="working directory"):
            check_output_dir(cwd_or_above, overwrite=True)
    assert check_output_dir(tmp_path / "new" / "deeper") == tmp_path / "new" / "deeper"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # the probe leaves nothing behind


def test_a_failed_staged_write_leaves_the_old_output_whole(tmp_path):
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "old.txt").write_text("old")
    with pytest.raises(RuntimeError), staged_dir(dest) as tmp:
        (tmp / "new.txt").write_text("half")
        raise RuntimeError("boom")
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and (dest / "old.txt").read_text() == "old"
    with staged_dir(dest) as tmp:
        (tmp / "new.txt").write_text("new")
    assert [p.name for p in dest.iterdir()] == ["new.txt"]
    write_text_atomic(tmp_path / "f.txt", "x")
    assert stat.S_IMODE((tmp_path / "f.txt").stat().st_mode) & 0o044 == 0o044  # readable by others, not 0600


@pytest.mark.parametrize(("edit", "match"), [
    (lambda sd: {}, "missing"),
    (lambda sd: {k: v for k, v in sd.items() if ".layers.0." not in k}, "missing"),
    (lambda sd: {**sd, "extra.weight": torch.zeros(2)}, "unexpected"),
    (lambda sd: {k: (torch.zeros(3, 3) if "q_proj" in k else v) for k, v in sd.items()}, "size mismatch"),
])
def test_load_model_refuses_weights_that_do_not_cover_the_model(tmp_path, trained, edit, match):
    shutil.copytree(trained, tmp_path / "m")
    (tmp_path / "m" / "manifest.json").unlink()
    sd = load_file(tmp_path / "m" / "model.safetensors")
    save_file(edit(sd), tmp_path / "m" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=match):
        load_model(tmp_path / "m")


def test_manifest_and_header_checks(tmp_path, trained):
    shutil.copytree(trained, tmp_path / "m")
    weights = tmp_path / "m" / "model.safetensors"
    raw = weights.read_bytes()
    assert check_safetensors_header(weights) == len(load_file(weights))
    weights.write_bytes(raw[:-1] + bytes([raw[-1] ^ 0xFF]))
    with pytest.raises(IntegrityError, match="checksum"):
        load_model(tmp_path / "m")
    weights.write_bytes(raw[: len(raw) - 100])
    with pytest.raises(IntegrityError, match="truncated"):
        check_safetensors_header(weights)
    (tmp_path / "m" / "manifest.json").write_text("{}")
    with pytest.raises(IntegrityError, match="not a kvstate manifest"):
        verify_manifest(tmp_path / "m")
    weights.write_bytes(raw)
    write_manifest(tmp_path / "m")
    model, saved = load_model(tmp_path / "m"), load_file(weights)
    assert saved and all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())  # loads what was written
    (tmp_path / "m" / "manifest.json").unlink()
    with pytest.raises(IntegrityError, match=r"no manifest\.json"):
        verify_manifest(tmp_path / "m", required=True)


@pytest.mark.parametrize(("family", "change", "match"), [
    ("qwen3", {"num_attention_heads": -4}, "num_attention_heads"),
    ("qwen3_5", {"linear_num_value_heads": 0}, "linear_num_value_heads"),
    ("mamba2", {"state_size": -1}, "state_size"),
    ("bamba", {"mamba_d_state": 0}, "mamba_d_state"),
])
def test_describe_refuses_impossible_dimensions(family, change, match):
    cfg = tiny_config(family)
    for k, v in change.items():
        setattr(cfg, k, v)
    with pytest.raises(ModelConfigError, match=match):
        describe(cfg)


def test_layer_types_must_match_the_layer_count():
    cfg = tiny_config("qwen3_5")
    cfg.layer_types = cfg.layer_types[:-1]
    with pytest.raises(ModelConfigError, match="layer_types"):
        describe(cfg)


def test_duplicate_tasks_and_lengths_and_position_limit():
    with pytest.raises(ValueError, match="more than once"):
        check_tasks(["qa", "qa"], [128])
    with pytest.raises(ValueError, match="more than once"):
        check_tasks(["qa"], [128, 128])
    with pytest.raises(ValueError, match="beyond"):
        check_tasks(["qa"], [10**8])
    cfg = tf.Qwen3Config(max_position_embeddings=1024)
    check_lengths_fit(cfg, [512])
    with pytest.raises(ValueError, match="max_position_embeddings=1,024"):
        check_lengths_fit(cfg, [1000])
