"""Bad input through the CLI: exit code 2, one line on stderr naming the input, no traceback, nothing changed on disk.

One test per class of failure a user can cause: overwriting a model, unwritable outputs, missing /
unexpected / corrupted weights, impossible configs, non-finite settings, duplicate tasks, lengths beyond
the model, malformed files, usage errors. Each runs ``kvstate`` through ``main`` (the console script).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import load_file, save_file

from tests.bad_input_util import TINY, assert_one_line_exit_2, fingerprint, run_cli, trained_model


@pytest.fixture
def trained(tmp_path_factory) -> Path:
    return trained_model(tmp_path_factory)

TINY_SET = [f"--set={k}={v}" for k, v in TINY.items()]



@pytest.fixture
def work(tmp_path, trained) -> Path:
    shutil.copytree(trained, tmp_path / "model")
    return tmp_path


def _weights(model: Path, edit) -> None:  # type: ignore[no-untyped-def]
    sd = load_file(model / "model.safetensors")
    save_file(edit(sd), model / "model.safetensors", metadata={"format": "pt"})
    (model / "manifest.json").unlink()  # a hand-edited copy: the load check, not the checksum, must catch it


def test_train_refuses_an_existing_model_dir(capsys, work):
    before = fingerprint(work)
    res = run_cli(capsys, "train", "--arch", "attn", "--out", work / "model", "--minutes", "0.05", *TINY_SET)
    assert_one_line_exit_2(res, "--out", "already holds", "--overwrite")
    assert fingerprint(work) == before


@pytest.mark.parametrize("where", ["file", "proc", "under_file"])
def test_train_unwritable_out_is_found_before_work(capsys, work, where):
    (work / "f").write_text("x")
    out = {"file": work / "f", "proc": Path("/proc/kvstate-test-out"), "under_file": work / "f" / "sub"}[where]
    before = fingerprint(work)
    res = run_cli(capsys, "train", "--arch", "attn", "--out", out, *TINY_SET)
    assert_one_line_exit_2(res, "--out")
    assert fingerprint(work) == before


@pytest.mark.parametrize("setting", ["lr=1e999", "lr=NaN", "lr=-1", "warmup_steps=0", "log_every=0", "threads=0",
                                     "lr=Infinity", "max_steps=0", "bf16=2", 'task_mix={"niah_single": NaN}',
                                     "hidden_size=2.5", "max_length=true", "seed=-1"])
def test_train_bad_settings(capsys, work, setting):
    before = fingerprint(work)
    res = run_cli(capsys, "train", "--arch", "attn", "--out", work / "new", "--set", setting)
    assert_one_line_exit_2(res, setting.split("=")[0])
    assert fingerprint(work) == before and not (work / "new").exists()


def test_train_init_from_a_missing_path(capsys, work):
    before = fingerprint(work)
    res = run_cli(capsys, "train", "--arch", "hybrid", "--out", work / "h", "--init-from", work / "nope",
                  *[s.replace("num_layers=1", "num_layers=4") for s in TINY_SET])
    assert_one_line_exit_2(res, "nope", "does not exist")
    assert fingerprint(work) == before


@pytest.mark.parametrize("damage", ["empty", "one_layer", "extra", "truncated", "garbage", "flipped", "nan"])
def test_eval_refuses_damaged_weights(capsys, work, damage):
    m = work / "model"
    if damage == "empty":
        _weights(m, lambda sd: {})
    elif damage == "one_layer":
        _weights(m, lambda sd: {k: v for k, v in sd.items() if not k.startswith("model.layers.0.")})
    elif damage == "extra":
        _weights(m, lambda sd: {**sd, "model.layers.9.foo": sd["model.norm.weight"].clone()})
    elif damage == "nan":
        _weights(m, lambda sd: {k: v * float("nan") if k == "model.norm.weight" else v for k, v in sd.items()})
    else:
        raw = (m / "model.safetensors").read_bytes()
        raw = {"truncated": raw[: len(raw) // 2], "garbage": b"\xff" * 64,
               "flipped": raw[:-10] + bytes([raw[-10] ^ 1]) + raw[-9:]}[damage]
        (m / "model.safetensors").write_bytes(raw)
        if damage != "flipped":
            (m / "manifest.json").unlink()
    needle = {"empty": "missing", "one_layer": "missing", "extra": "unexpected", "truncated": "truncated",
              "garbage": "safetensors", "flipped": "checksum", "nan": "NaN"}[damage]
    before = fingerprint(work)
    res = run_cli(capsys, "eval", "--model", m, "--task", "niah_single", "--length", "128", "--n", "1")
    assert_one_line_exit_2(res, str(m), needle)
    assert fingerprint(work) == before


def test_eval_on_an_intact_copy_runs(capsys, work):
    code, out, _ = run_cli(capsys, "eval", "--model", work / "model", "--task", "niah_single", "--length", "128",
                           "--n", "1", "--json")
    assert code == 0 and json.loads(out.strip().splitlines()[-1])["results"][0]["n"] == 1


@pytest.mark.parametrize(("args", "needles"), [
    (["--task", "niah_single,niah_single", "--length", "128"], ["niah_single", "more than once"]),
    (["--task", "niah_single", "--length", "128,128"], ["128", "more than once"]),
    (["--task", "niah_single", "--length", "100000000"], ["100,000,000"]),
    (["--task", "niah_single", "--length", "16000"], ["max_position_embeddings"]),
    (["--task", "niah_single", "--length", "1_000"], ["1_000"]),
    (["--task", "niah_single", "--length", "128", "--n", "0"], ["--n"]),
    (["--task", "niah_single", "--length", "128", "--n", "10000000"], ["--n"]),
])
def test_eval_bad_arguments(capsys, work, args, needles):
    res = run_cli(capsys, "eval", "--model", work / "model", *args)
    assert_one_line_exit_2(res, *needles)


def _config(work: Path, **changes) -> Path:  # type: ignore[no-untyped-def]
    cfg = json.loads((work / "model" / "config.json").read_text())
    cfg.update(changes)
    (work / "model" / "config.json").write_text(json.dumps(cfg))
    return work / "model"


@pytest.mark.parametrize(("change", "needle"), [
    ({"num_attention_heads": -4}, "num_attention_heads"),
    ({"num_key_value_heads": 0}, "num_key_value_heads"),
    ({"hidden_size": "big"}, "hidden_size"),
    ({"dtype": "float7"}, "float7"),
    ({"num_hidden_layers": 10**12}, "num_hidden_layers"),
    ({"num_attention_heads": 3, "num_key_value_heads": 2}, "multiple"),
])
def test_info_refuses_impossible_configs(capsys, work, change, needle):
    res = run_cli(capsys, "info", _config(work, **change), "--json")
    assert_one_line_exit_2(res, needle)


def test_info_on_a_non_utf8_config(capsys, work):
    (work / "model" / "config.json").write_bytes(b"\xff\xfe{}")
    assert_one_line_exit_2(run_cli(capsys, "info", work / "model"), "config.json", "UTF-8")


@pytest.mark.parametrize(("kind", "needle"), [
    ("complex", "numbers"), ("strings", "numbers"), ("npz", ".npz"), ("truncated", ".npy"), ("directory", "directory"),
    ("nan", "NaN"), ("2d", "1-D"),
])
def test_plan_bad_weight_files(capsys, tmp_path, kind, needle):
    path = tmp_path / "w.npy"
    if kind == "complex":
        np.save(path, np.array([1 + 1j, 2, 3]))
    elif kind == "strings":
        np.save(path, np.array(["1", "2", "3"]))
    elif kind == "npz":
        np.savez(tmp_path / "w.npz", w=np.ones(4))
        (tmp_path / "w.npz").rename(path)
    elif kind == "truncated":
        np.save(path, np.ones(100))
        path.write_bytes(path.read_bytes()[:90])
    elif kind == "directory":
        path.mkdir()
    elif kind == "nan":
        np.save(path, np.array([1.0, float("nan"), 1.0]))
    else:
        np.save(path, np.ones((3, 3)))
    before = fingerprint(tmp_path)
    res = run_cli(capsys, "plan", "--weights", path, "--slots", "2")
    assert_one_line_exit_2(res, needle)
    assert fingerprint(tmp_path) == before


def test_plan_huge_weights_give_the_true_recompute(capsys, tmp_path):
    np.save(tmp_path / "w.npy", np.array([1e308, 1e308, 1e308]))
    code, out, _ = run_cli(capsys, "plan", "--weights", tmp_path / "w.npy", "--slots", "1", "--method", "block",
                           "--json")
    assert code == 0 and json.loads(out.strip().splitlines()[-1])["methods"]["block"]["expected_recompute"] == 1.0


@pytest.mark.parametrize(("content", "needle"), [
    (b'{"overlap": 3, "length": 300000000}\n', "t.jsonl:1"),
    (b'{"overlap": 3, "length": 9}\n\xff\xfe\n', "UTF-8"),
    (b'{"overlap": 3, "length": 9, "prefix_id": [1]}\n', "prefix_id"),
    (b"[" * 100000 + b"\n", "t.jsonl:1"),
])
def test_plan_bad_traces(capsys, tmp_path, content, needle):
    (tmp_path / "t.jsonl").write_bytes(content)
    before = fingerprint(tmp_path)
    assert_one_line_exit_2(run_cli(capsys, "plan", "--trace", tmp_path / "t.jsonl", "--slots", "2"), needle)
    assert fingerprint(tmp_path) == before


@pytest.mark.parametrize("plot", ["missing_dir/p.png", "p.unknownformat", "."])
def test_plan_unwritable_plot(capsys, tmp_path, plot):
    np.save(tmp_path / "w.npy", np.ones(10))
    before = fingerprint(tmp_path)
    res = run_cli(capsys, "plan", "--weights", tmp_path / "w.npy", "--slots", "2", "--plot", tmp_path / plot)
    assert_one_line_exit_2(res, "--plot")
    assert fingerprint(tmp_path) == before


@pytest.mark.parametrize("args", [["plan", "--slots", "x"], ["plan"], ["info"], ["nonsense"], ["eval", "--n", "2"],
                                  ["plan", "--slots", "2", "--weights"]])
def test_usage_errors_are_one_line(capsys, args):
    assert_one_line_exit_2(run_cli(capsys, *args))


def test_long_messages_are_not_wrapped(capsys, tmp_path):
    deep = tmp_path / ("d" * 150) / "w.npy"
    line = assert_one_line_exit_2(run_cli(capsys, "plan", "--weights", deep, "--slots", "2"), str(deep))
    assert len(line) > 160


def test_debug_keeps_the_traceback(capsys, tmp_path):
    from kvstate.errors import ModelLoadError

    with pytest.raises(ModelLoadError):
        run_cli(capsys, "--debug", "info", tmp_path / "missing")
