"""The conventions every command shares: ``--json`` prints exactly one JSON document on stdout (tables,
progress and notes on stderr), list options go through one parser, ``--n`` / ``--seed`` have one range,
and ``--out FILE`` refuses to replace a file without ``--overwrite``. Every command with ``--json`` runs
here on tiny random models (a few seconds each)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from kvstate.cli import app
from kvstate.errors import KVStateError, OutputError
from kvstate.lab.lists import ListOptionError
from kvstate.lab.workloads.tokenizer import build_tokenizer
from kvstate.models import tiny_model

runner = CliRunner()


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("conventions")
    tok = build_tokenizer()
    out: dict[str, Path] = {}
    for name, seed in (("producer", 0), ("consumer", 1)):
        m = tiny_model("qwen3", seed=seed, vocab_size=len(tok), max_position_embeddings=4096)
        m.save_pretrained(root / name)
        tok.save_pretrained(root / name)
        out[name] = root / name
    tiny_model("qwen3_5").save_pretrained(root / "hybrid")
    out["hybrid"] = root / "hybrid"
    res = runner.invoke(app, ["transfer", "calibrate", "--producer", str(out["producer"]), "--consumer",
                              str(out["consumer"]), "--out", str(root / "codec"), "--prefixes", "4", "--length", "96",
                              "--rank-k", "4", "--rank-v", "8", "--rank-h", "16", "--patch", "1"])
    assert res.exit_code == 0, res.output
    out["codec"] = root / "codec"
    res = runner.invoke(app, ["prefix", "trace", "--workload", "quality", "--n", "6", "--scale", "0.01", "--vocab",
                              "128", "--out", str(root / "t.jsonl")])
    assert res.exit_code == 0, res.output
    out["trace"] = root / "t.jsonl"
    w = np.zeros(101)
    w[0], w[70], w[100] = 6, 3, 1
    np.save(root / "w.npy", w)
    out["weights"] = root / "w.npy"
    return out


def _replay_args(d: dict[str, Path]) -> list[str]:
    return ["prefix", "replay", "--model", str(d["hybrid"]), "--trace", str(d["trace"]), "--budget-bytes",
            str(64 << 20), "--slots", "1,2", "--planner", "optimal", "--align", "8", "--limit", "3", "--json"]


COMMANDS = {
    "info": lambda d: ["info", str(d["producer"]), "--json"],
    "plan": lambda d: ["plan", "--weights", str(d["weights"]), "--slots", "2", "--method", "optimal,block", "--json"],
    "eval": lambda d: ["eval", "--model", str(d["producer"]), "--task", "niah_single", "--length", "128", "--n", "1",
                       "--json"],
    "prefix replay": _replay_args,
    "depth eval": lambda d: ["depth", "eval", "--model", str(d["producer"]), "--keep", "1", "--n", "1", "--json"],
    "semantic eval": lambda d: ["semantic", "eval", "--model", str(d["producer"]), "--task", "niah_single", "--length",
                                "256", "--n", "1", "--methods", "full,sekv", "--budget", "0.5", "--json"],
    "transfer bench": lambda d: ["transfer", "bench", "--producer", str(d["producer"]), "--consumer",
                                 str(d["consumer"]), "--codec", str(d["codec"]), "--n", "1", "--length", "256",
                                 "--ppl-n", "1", "--weak-n", "0", "--ablation-n", "0", "--json"],
}


def _one_document(stdout: str) -> object:
    # json.loads refuses anything around the document ("Extra data"), so a table or a second line fails here
    return json.loads(stdout)


@pytest.mark.parametrize("command", list(COMMANDS))
def test_json_prints_exactly_one_document_on_stdout(dirs, command):
    res = runner.invoke(app, COMMANDS[command](dirs))
    assert res.exit_code == 0, res.output
    doc = _one_document(res.stdout)
    assert isinstance(doc, dict) and doc
    if command not in ("info", "plan"):  # the table went to stderr
        assert "─" in res.stderr or "━" in res.stderr, res.stderr


def test_transfer_generate_json_is_one_document(dirs):
    from kvstate.lab.harness import load_reference
    from kvstate.transfer.codec import Codec
    from kvstate.transfer.serving import producer_service
    from kvstate.transfer.store import open_store
    from kvstate.transfer.transport import ServerThread

    model, _ = load_reference(dirs["producer"])
    with ServerThread(producer_service(model, Codec.load(dirs["codec"]), open_store("memory://"))) as server:
        res = runner.invoke(app, ["transfer", "generate", "--consumer", str(dirs["consumer"]), "--codec",
                                  str(dirs["codec"]), "--server", f"127.0.0.1:{server.port}", "--prompt",
                                  "the cat sat on the mat . answer :", "--max-new-tokens", "2", "--json"])
    assert res.exit_code == 0, res.output
    doc = _one_document(res.stdout)
    assert isinstance(doc, dict) and doc["new_tokens"] >= 1


def test_prefix_replay_json_pipes_in_a_real_process(dirs):
    res = subprocess.run([sys.executable, "-m", "kvstate.cli", *_replay_args(dirs)], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    doc = _one_document(res.stdout)
    assert isinstance(doc, dict) and [(r["planner"], r["slots"]) for r in doc["results"]] == [("optimal", 1),
                                                                                             ("optimal", 2)]


@pytest.mark.parametrize(("args", "needles"), [
    (["eval", "--model", "m", "--task", "niah_single", "--length", "1K,1024"], ["--length", "more than once"]),
    (["eval", "--model", "m", "--task", "niah_single,niah_single", "--length", "128"], ["--task", "more than once"]),
    (["eval", "--model", "m", "--task", "niah_single", "--length", ""], ["--length", "empty"]),
    (["depth", "eval", "--model", "m", "--keep", "1,1.0"], ["--keep", "more than once"]),
    (["depth", "eval", "--model", "m", "--keep", "1.5"], ["--keep", "out of range"]),
    (["semantic", "eval", "--model", "m", "--length", "1K"], []),  # a K suffix parses here too: fails on the model
    (["semantic", "eval", "--model", "m", "--length", "²"], ["--length", "not a whole number"]),
    (["semantic", "eval", "--model", "m", "--budget", "0.5,0.5"], ["--budget", "more than once"]),
    (["semantic", "eval", "--model", "m", "--task", "nope"], ["--task 'nope' is unknown"]),
    (["semantic", "eval", "--model", "m", "--methods", "full,full"], ["--methods", "more than once"]),
    (["semantic", "train", "--model", "m", "--out", "o", "--length", "512,,1K"], ["--length", "empty item"]),
    (["transfer", "bench", "--length", "256,0.5K"], ["--length", "not a whole number"]),
    (["transfer", "calibrate", "--producer", "p", "--consumer", "c", "--out", "o", "--patch", "²"], ["--patch"]),
    (["plan", "--weights", "w.npy", "--slots", "2", "--method", "optimal", "--method", "optimal"],
     ["--method", "more than once"]),
])
def test_list_options_are_refused_before_any_work(args, needles):
    res = runner.invoke(app, args)
    assert res.exit_code != 0 and isinstance(res.exception, KVStateError), res.output
    if needles:
        assert isinstance(res.exception, ListOptionError) or "--patch" in needles
        assert all(n in str(res.exception) for n in needles), str(res.exception)
    else:
        assert not isinstance(res.exception, ListOptionError), str(res.exception)


def test_replay_slots_and_planners_refuse_duplicates(dirs):
    args = _replay_args(dirs)
    args[args.index("1,2")] = "2,2"
    res = runner.invoke(app, args)
    assert isinstance(res.exception, ListOptionError) and "--slots: '2' given more than once" in str(res.exception)


@pytest.mark.parametrize("args", [
    ["eval", "--model", "m", "--task", "niah_single", "--length", "128", "--n", "0"],
    ["eval", "--model", "m", "--task", "niah_single", "--length", "128", "--seed", "-1"],
    ["depth", "eval", "--model", "m", "--n", "0"],
    ["semantic", "eval", "--model", "m", "--seed", "-1"],
    ["transfer", "bench", "--n", "0"],
    ["prefix", "trace", "--workload", "quality", "--out", "t.jsonl", "--n", "0"],
])
def test_n_and_seed_have_one_range(args):
    option = "--n" if "--n" in args else "--seed"
    res = runner.invoke(app, args)
    assert res.exit_code == 2 and f"'{option}'" in res.stderr, res.output
    assert f"greater than or equal to {1 if option == '--n' else 0}" in " ".join(res.stderr.split()), res.stderr


def test_out_file_needs_overwrite(dirs, tmp_path):
    out = tmp_path / "t.jsonl"
    out.write_text("mine\n")
    args = ["prefix", "trace", "--workload", "quality", "--n", "2", "--scale", "0.01", "--out", str(out)]
    res = runner.invoke(app, args)
    assert isinstance(res.exception, OutputError) and "--overwrite" in str(res.exception)
    assert out.read_text() == "mine\n"
    res = runner.invoke(app, [*args, "--overwrite"])
    assert res.exit_code == 0 and out.read_text() != "mine\n", res.output
    bench = tmp_path / "bench.json"  # a result --out appends runs, but only to a result file
    bench.write_text("mine, not a result file")
    res = runner.invoke(app, [*COMMANDS["transfer bench"](dirs), "--out", str(bench)])
    assert isinstance(res.exception, OutputError) and "not a kvstate result file" in str(res.exception)
    res = runner.invoke(app, ["depth", "eval", "--model", str(dirs["producer"]), "--keep", "1", "--out", str(bench)])
    assert isinstance(res.exception, OutputError) and bench.read_text() == "mine, not a result file"
    res = runner.invoke(app, ["transfer", "calibrate", "--producer", str(dirs["producer"]), "--consumer",
                              str(dirs["consumer"]), "--out", str(dirs["codec"])])
    assert isinstance(res.exception, OutputError) and "--overwrite" in str(res.exception)
