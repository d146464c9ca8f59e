"""``kvstate prefix trace|replay`` on a tiny saved model, bad input, and fast start of the pure commands."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from kvstate.cli import app
from kvstate.errors import KVStateError
from kvstate.lab.workloads.traces import Request, write_trace
from kvstate.models import tiny_model

runner = CliRunner()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-hybrid")
    tiny_model("qwen3_5").save_pretrained(path)
    return path


def test_replay_prints_the_table_and_one_json_line(model_dir, tmp_path):
    trace = tmp_path / "t.jsonl"
    res = runner.invoke(
        app,
        [
            "prefix",
            "trace",
            "--workload",
            "quality",
            "-n",
            "6",
            "--scale",
            "0.01",
            "--vocab",
            "128",
            "--out",
            str(trace),
        ],
    )
    assert res.exit_code == 0 and trace.is_file(), res.output
    res = runner.invoke(
        app,
        [
            "prefix",
            "replay",
            "--model",
            str(model_dir),
            "--trace",
            str(trace),
            "--budget-bytes",
            str(64 << 20),
            "--slots",
            "2",
            "--planner",
            "optimal",
            "--planner",
            "balanced",
            "--align",
            "8",
            "--limit",
            "5",
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    data = json.loads(res.output.strip().splitlines()[-1])
    assert data["trace"] == str(trace) and [r["planner"] for r in data["results"]] == ["optimal", "balanced"]
    for r in data["results"]:
        assert r["requests"] == 5 and r["tokens_reused"] + r["tokens_recomputed"] == r["tokens_total"] > 0
        assert r["slots"] == 2 and r["budget_bytes"] == 64 << 20 and r["wall_s_no_cache"] > 0
        assert r["kv_bytes_held"] == r["kv_bytes_distinct"] > 0 and r["peak_bytes"] > 0
        assert {"predicted_reused", "wall_s"} <= set(r)


@pytest.mark.parametrize(
    ("tokens", "budget", "planner", "message"),
    [
        ([5, 6, 700], 1 << 20, "optimal", "outside the model's vocabulary"),
        ([5, 6, 7], 10, "optimal", "smaller than one recurrent checkpoint"),
        ([5, 6, 7], 1 << 20, "nope", "planner='nope'"),
    ],
)
def test_replay_bad_input_is_one_clear_error(model_dir, tmp_path, tokens, budget, planner, message):
    trace = tmp_path / "t.jsonl"
    write_trace(trace, [Request(tuple(tokens), None, 0, len(tokens))])
    res = runner.invoke(
        app,
        [
            "prefix",
            "replay",
            "--model",
            str(model_dir),
            "--trace",
            str(trace),
            "--slots",
            "2",
            "--budget-bytes",
            str(budget),
            "--planner",
            planner,
        ],
    )
    assert isinstance(res.exception, KVStateError) and message in str(res.exception)


def test_replay_bad_input_exits_2_with_one_line(model_dir, tmp_path):
    trace = tmp_path / "t.jsonl"
    write_trace(trace, [Request((1, 2, 3), None, 0, 3)])
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvstate.cli",
            "prefix",
            "replay",
            "--model",
            str(model_dir),
            "--trace",
            str(trace),
            "--budget-bytes",
            "1000000",
            "--slots",
            "2",
            "--planner",
            "nope",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 2 and "planner='nope'" in res.stderr and "Traceback" not in res.stderr


def test_plan_starts_without_torch_or_transformers(tmp_path):
    import numpy as np

    np.save(tmp_path / "w.npy", np.array([1.0, 0.0, 0.0, 2.0, 1.0]))
    res = subprocess.run(
        [
            sys.executable,
            "-X",
            "importtime",
            "-m",
            "kvstate.cli",
            "plan",
            "--weights",
            str(tmp_path / "w.npy"),
            "--slots",
            "1",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    loaded = {
        line.rsplit("|", 1)[-1].strip() for line in res.stderr.splitlines() if line.startswith("import time")
    }
    assert res.returncode == 0 and "numpy" in loaded and not loaded & {"torch", "transformers"}


def test_replay_with_tree_placement(model_dir, tmp_path):
    trace = tmp_path / "t.jsonl"
    doc = list(range(3, 43))
    prompts = [(*doc, 100 + i, 110 + i) for i in range(3)]
    write_trace(trace, [Request(tokens=p, prefix_id=None, overlap=0, length=len(p)) for p in prompts])
    args = ["prefix", "replay", "--model", str(model_dir), "--trace", str(trace), "--budget-bytes", str(64 << 20)]
    args += ["--slots", "2", "--planner", "optimal", "--align", "8", "--placement", "tree", "--no-baseline", "--json"]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    (r,) = json.loads(res.output.strip().splitlines()[-1])["results"]
    # the second question resumes from the first's evenly spread checkpoint at 32, the third from 40 (the document)
    assert r["placement"] == "tree" and r["tokens_reused"] == 32 + 40 and r["tokens_lost"] == 8
