"""The kvstate CLI: info on saved tiny models of every family, clear errors with exit code 2, report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import transformers as tf
from typer.testing import CliRunner

from kvstate.cli import app
from kvstate.models import describe, qwen35_08b_config
from tests.conftest import FAMILIES, get_model

runner = CliRunner()


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    out = {}
    for fam in FAMILIES:
        get_model(fam).save_pretrained(root / fam)
        out[fam] = root / fam
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_info_json_on_each_family(saved, family):
    res = runner.invoke(app, ["info", str(saved[family]), "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output.strip().splitlines()[-1])
    expected = describe(get_model(family).config)
    assert data["layer_kinds"] == expected.layer_kinds
    assert data["kv_bytes_per_token"] == expected.kv_bytes_per_token
    assert data["checkpoint_bytes"] == expected.checkpoint_bytes
    assert data["chunk_size"] == expected.chunk_size
    assert set(data) >= {"layer_kinds", "kv_bytes_per_token", "checkpoint_bytes", "chunk_size"}


def test_info_table_for_qwen35_08b_shape(tmp_path):
    qwen35_08b_config().save_pretrained(tmp_path / "q")
    res = runner.invoke(app, ["info", str(tmp_path / "q")])
    assert res.exit_code == 0, res.output
    assert "1,608 tokens of KV" in res.output and "12,288 B" in res.output


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvstate.cli", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        ("missing", "does not exist"),
        ("empty", "no config.json"),
        ("vit", "not a causal language model"),
        ("gpt2", "supported families"),
    ],
)
def test_bad_model_dirs_exit_2_without_traceback(tmp_path, setup, message):
    path = tmp_path / setup
    if setup == "empty":
        path.mkdir()
    elif setup == "vit":
        tf.ViTConfig().save_pretrained(path)
    elif setup == "gpt2":
        tf.GPT2Config().save_pretrained(path)
    res = _run_cli("info", str(path))
    assert res.returncode == 2
    assert message in " ".join(res.stderr.split())
    assert "Traceback" not in res.stderr


def test_debug_shows_the_traceback(tmp_path):
    res = _run_cli("--debug", "info", str(tmp_path / "missing"))
    assert res.returncode != 0 and "ModelLoadError" in res.stderr


def test_report_writes_html_and_summary(tmp_path):
    out = tmp_path / "r"
    res = runner.invoke(app, ["report", "--out", str(out), "--models", str(tmp_path / "none"),
                              "--section", "model state"])
    assert res.exit_code == 0, res.output
    html = (out / "index.html").read_text()
    summary = json.loads((out / "summary.json").read_text())
    assert "Qwen3.5-0.8B shape" in html and "<img" in html
    assert summary["sections"]["model_state"]["Qwen3.5-0.8B shape (bf16)"]["checkpoint_bytes"] == 19759104
    assert (out / "model_state_bytes.png").stat().st_size > 1000
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("mine")
    res = _run_cli("report", "--out", str(tmp_path / "notes"), "--section", "model state")
    assert res.returncode == 2 and "is not a kvstate report" in " ".join(res.stderr.split())
    assert "Traceback" not in res.stderr and (tmp_path / "notes" / "a.txt").read_text() == "mine"


def test_plan_compares_methods_from_weights_and_trace(tmp_path):
    import numpy as np

    from kvstate.lab.workloads.traces import generate, write_trace

    w = np.zeros(1001)
    w[0], w[700], w[1000] = 6, 3, 1
    np.save(tmp_path / "w.npy", w)
    res = runner.invoke(app, ["plan", "--weights", str(tmp_path / "w.npy"), "--slots", "2", "--json",
                              "--plot", str(tmp_path / "p.png")])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output.strip().splitlines()[-1])
    assert data["methods"]["optimal"]["positions"] == [700, 1000]
    assert data["methods"]["optimal"]["expected_recompute"] == 0.0
    assert all(m["expected_recompute"] >= 0.0 for m in data["methods"].values())
    assert (tmp_path / "p.png").stat().st_size > 1000
    write_trace(tmp_path / "t.jsonl", generate("quality", 30, seed=0, scale=0.02))
    res = runner.invoke(app, ["plan", "--trace", str(tmp_path / "t.jsonl"), "--slots", "4", "--method", "optimal"])
    assert res.exit_code == 0 and "optimal" in res.output, res.output


def test_plan_bad_input_exits_2(tmp_path):
    (tmp_path / "t.jsonl").write_text('{"overlap": 3, "length": 9}\nnot json\n')
    res = _run_cli("plan", "--trace", str(tmp_path / "t.jsonl"), "--slots", "2")
    assert res.returncode == 2 and "t.jsonl:2" in res.stderr
    import numpy as np

    np.save(tmp_path / "w.npy", np.array([1.0, -1.0, 2.0]))
    res = _run_cli("plan", "--weights", str(tmp_path / "w.npy"), "--slots", "2")
    assert res.returncode == 2 and "weights" in res.stderr


_AXIS_CLIS = ("kvstate.lab.prefix.cli", "kvstate.lab.depth.cli", "kvstate.lab.semantic.cli",
              "kvstate.lab.transfer.cli", "kvstate.lab.make.cli", "kvstate.lab.training.cli", "kvstate.serve.cli")


def _imported_after(argv: list[str]) -> set[str]:
    code = ("import sys\nfrom kvstate.cli import main\ntry:\n    main(" + repr(argv) + ")\nexcept SystemExit:\n"
            "    pass\nprint(' '.join(m for m in sys.modules if m.startswith('kvstate')))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return set(res.stdout.split()[-1000:])


def test_an_axis_command_imports_only_its_own_axis():
    # a result's executed-code digest covers what its process imported: a depth run must not import the
    # other axes' CLIs (an edit there would otherwise make every result stale)
    loaded = _imported_after(["depth", "eval", "--help"])
    assert "kvstate.lab.depth.cli" in loaded
    assert not {m for m in _AXIS_CLIS if m != "kvstate.lab.depth.cli"} & loaded
    assert not {m for m in loaded if m.startswith(("kvstate.lab.semantic", "kvstate.lab.transfer",
                                                     "kvstate.lab.prefix", "kvstate.serve"))}


def test_top_level_help_lists_every_lazy_command_and_typos_suggest_them():
    res = runner.invoke(app, ["--help"])
    assert res.exit_code == 0
    for name in ("info", "report", "plan", "train", "eval", "prefix", "depth", "semantic", "transfer", "lab",
                 "serve"):
        assert f" {name} " in res.output
    res = subprocess.run([sys.executable, "-m", "kvstate.cli", "semantc"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert res.stderr.strip() == "error: No such command 'semantc'. Did you mean 'semantic'? (see kvstate --help)"
