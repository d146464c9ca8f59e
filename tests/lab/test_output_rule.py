"""One output rule for every command, checked on a scratch copy of the committed ``models/``: outputs that are
inputs, directories of another kind, files a manifest covers and hand-written cards are refused (one line, exit 2)
and every file stays byte-identical; duplicate / empty lists and lengths past the model's positions are refused
before any weights load; results are appended, never replaced."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kvstate.errors import OutputError
from kvstate.integrity import read_manifest
from kvstate.lab.cli_output import check_card_out, check_results_out, set_threads
from kvstate.lab.provenance import append_run, read_runs
from tests.bad_input_util import assert_one_line_exit_2, fingerprint, run_cli

REPO_MODELS = Path(__file__).resolve().parents[2] / "models"
NEEDED = ("ref-attn", "ref-attn-ft", "ref-attn-rcla", "ref-attn-sekv", "ref-hybrid-sekv", "codec-ref-attn-ft")


def test_every_committed_model_carries_a_checksum_manifest_that_verifies():
    dirs = [d for d in sorted(REPO_MODELS.iterdir()) if (d / "model.safetensors").is_file()]
    assert len(dirs) >= 7
    for d in dirs:
        m = read_manifest(d, kind="model", covers=("model.safetensors", "config.json", "tokenizer.json"))
        assert "README.md" not in m["files"] and not any(n.endswith("eval.json") for n in m["files"])


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    root = tmp_path_factory.mktemp("scratch") / "models"
    root.mkdir()
    for name in NEEDED:
        shutil.copytree(REPO_MODELS / name, root / name)
    return root


@pytest.fixture
def unchanged(scratch):
    before = fingerprint(scratch)
    yield scratch
    assert fingerprint(scratch) == before  # byte-identical: size, SHA-256 and mode of every file


def _refused(capsys, *args, needles=()):
    return assert_one_line_exit_2(run_cli(capsys, *args), *needles)


@pytest.mark.parametrize(("args", "needles"), [
    (["depth", "train", "--model", "{M}/ref-attn", "--out", "{M}/ref-attn", "--tokens", "256"], ["is the input"]),
    (["depth", "train", "--model", "{M}/ref-attn", "--out", "{M}/ref-attn", "--tokens", "256", "--resume"],
     ["is the input"]),
    (["depth", "train", "--model", "{M}/ref-attn", "--out", "{M}/ref-attn-ft", "--tokens", "256", "--resume"],
     ["is not a depth run"]),
    (["depth", "train", "--model", "{M}/ref-attn", "--out", "{M}/ref-attn-sekv", "--tokens", "256", "--overwrite"],
     ["is not a model directory"]),
    (["depth", "train", "--model", "{M}/ref-attn", "--out", "{M}/ref-attn/run", "--tokens", "256"], ["lies inside"]),
    (["depth", "init-kv1", "--model", "{M}/ref-attn", "--out", "{M}/codec-ref-attn-ft", "--overwrite"],
     ["is not a model directory"]),
    (["depth", "card", "--model", "{M}/ref-attn"], ["not a depth run"]),
    (["semantic", "train", "--model", "{M}/ref-attn", "--out", "{M}/ref-attn-ft", "--overwrite"],
     ["is not a SEKV router directory"]),
    (["semantic", "train", "--model", "{M}/ref-attn", "--out", "{M}/ref-attn", "--overwrite"], ["is the input"]),
    (["semantic", "eval", "--model", "{M}/ref-attn", "--out", "{M}/ref-attn/config.json"], ["checksum manifest"]),
    (["semantic", "eval", "--model", "{M}/ref-attn", "--out", "{M}/ref-attn-sekv/manifest.json", "--overwrite"],
     ["checksum manifest"]),
    (["semantic", "eval", "--model", "{M}/ref-attn", "--out", "{M}/ref-attn/README.md"], ["not a kvstate result file"]),
    (["semantic", "eval", "--model", "{M}/ref-attn", "--methods", "full,kvpress", "--kvpress-venv", "{M}/ref-attn"],
     ["not a Python environment"]),
    (["depth", "eval", "--model", "{M}/ref-attn", "--out", "{M}/ref-attn/model.safetensors"], ["checksum manifest"]),
    (["transfer", "calibrate", "--producer", "{M}/ref-attn", "--consumer", "{M}/ref-attn-ft", "--out",
      "{M}/ref-attn-ft", "--overwrite"], ["is the input --consumer"]),
    (["transfer", "calibrate", "--producer", "{M}/ref-attn", "--consumer", "{M}/ref-attn-ft", "--out",
      "{M}/ref-attn-rcla", "--overwrite"], ["is not a codec directory"]),
    (["transfer", "card"], ["nothing is written to a default path"]),
    (["transfer", "card", "--model", "{M}/ref-attn-ft", "--base", "{M}/ref-attn", "--command", "x"],
     ["already exists", "--overwrite"]),
    (["transfer", "card", "--codec", "{M}/codec-ref-attn-ft", "--command", "x"], ["already exists"]),
    (["transfer", "card", "--codec", "{M}/ref-attn", "--command", "x", "--overwrite"], ["is not a codec directory"]),
    (["transfer", "bench", "--codec", "{M}/codec-ref-attn-ft", "--out", "{M}/codec-ref-attn-ft/codec.safetensors"],
     ["checksum manifest"]),
])
def test_committed_files_are_never_outputs(capsys, unchanged, args, needles):
    _refused(capsys, *[a.replace("{M}", str(unchanged)) for a in args], needles=needles)


def test_a_depth_card_never_replaces_a_hand_written_readme(capsys, tmp_path, scratch):
    d = tmp_path / "run"
    d.mkdir()
    for f in ("training_state.json", "depth_eval.json"):
        shutil.copy(scratch / "ref-attn-rcla" / f, d / f)
    (d / "README.md").write_text("# my notes\n")
    _refused(capsys, "depth", "card", "--model", d, needles=["not written by this card command"])
    assert (d / "README.md").read_text() == "# my notes\n"
    code, _, _ = run_cli(capsys, "depth", "card", "--model", d, "--overwrite")
    assert code == 0 and "Generated by `kvstate depth card`" in (d / "README.md").read_text()
    code, _, _ = run_cli(capsys, "depth", "card", "--model", d)  # its own card: rewritten without --overwrite
    assert code == 0


@pytest.mark.parametrize(("args", "needles"), [
    (["depth", "eval", "--model", "{M}/ref-attn", "--keep", "1,1"], ["--keep", "more than once"]),
    (["depth", "eval", "--model", "{M}/ref-attn", "--keep", ""], ["--keep", "empty"]),
    (["depth", "eval", "--model", "{M}/ref-attn", "--pattern-kind", "nope"], ["--pattern-kind"]),
    (["semantic", "eval", "--model", "{M}/ref-attn", "--budget", "0.25,0.25"], ["--budget", "more than once"]),
    (["semantic", "eval", "--model", "{M}/ref-attn", "--length", "1K,1024"], ["the same value"]),
    (["semantic", "eval", "--model", "{M}/ref-attn", "--task", ""], ["--task", "empty"]),
    (["semantic", "eval", "--model", "{M}/ref-attn", "--methods", "full,full"], ["--methods", "more than once"]),
    (["semantic", "eval", "--model", "{M}/ref-attn", "--methods", "kvpress,SnapKVPress"], ["names SnapKVPress twice"]),
    (["semantic", "train", "--model", "{M}/ref-attn", "--out", "{T}/r", "--length", "128,128"], ["more than once"]),
    (["transfer", "bench", "--codec", "{M}/codec-ref-attn-ft", "--length", "²"], ["not a whole number"]),
    (["transfer", "calibrate", "--producer", "{M}/ref-attn", "--consumer", "{M}/ref-attn-ft", "--out", "{T}/c",
      "--patch", "²"], ["--patch"]),
    (["depth", "train", "--model", "{M}/ref-attn", "--out", "{T}/d", "--tokens", "256", "--pattern", "0_²_2_2"],
     ["not of the form"]),
])
def test_duplicate_empty_and_malformed_lists_are_refused(capsys, unchanged, tmp_path, args, needles):
    _refused(capsys, *[a.replace("{M}", str(unchanged)).replace("{T}", str(tmp_path)) for a in args], needles=needles)


@pytest.mark.parametrize(("args", "needles"), [
    (["depth", "train", "--model", "{M}/ref-attn", "--out", "{T}/d", "--tokens", "256", "--length", "16384"],
     ["max_position_embeddings=8,192"]),
    (["depth", "train", "--model", "{M}/ref-attn", "--out", "{T}/d", "--minutes", "inf"], ["--minutes"]),
    (["depth", "train", "--model", "{M}/ref-attn", "--out", "{T}/d", "--tokens", str(10**30)], ["--tokens"]),
    (["depth", "train", "--model", "{M}/ref-attn", "--out", "{T}/d", "--tokens", "256", "--seed", str(2**70)],
     ["--seed"]),
    (["semantic", "train", "--model", "{M}/ref-attn", "--out", "{T}/r", "--length", "16384"],
     ["max_position_embeddings=8,192"]),
    (["semantic", "train", "--model", "{M}/ref-attn", "--out", "{T}/r", "--max-steps", "0"], ["max_steps"]),
    (["semantic", "train", "--model", "{M}/ref-attn", "--out", "{T}/r", "--minutes", "inf"], ["minutes"]),
    (["semantic", "train", "--model", "{M}/ref-attn", "--out", "{T}/r", "--threads", "0"], ["--threads"]),
    (["semantic", "eval", "--model", "{M}/ref-attn", "--length", "8192"], ["max_position_embeddings=8,192"]),
    (["semantic", "eval", "--model", "{M}/ref-attn", "--n", str(10**7)], ["--n"]),
    (["semantic", "eval", "--model", "{M}/ref-attn", "--threads", "-1"], ["--threads"]),
    (["transfer", "calibrate", "--producer", "{M}/ref-attn", "--consumer", "{M}/ref-attn-ft", "--out", "{T}/c",
      "--length", "100000"], ["max_position_embeddings=8,192"]),
    (["transfer", "calibrate", "--producer", "{M}/ref-attn", "--consumer", "{M}/ref-attn-ft", "--out", "{T}/c",
      "--prefixes", str(10**9)], ["prefixes"]),
    (["transfer", "generate", "--consumer", "{M}/ref-attn-ft", "--codec", "{M}/codec-ref-attn-ft", "--server",
      "127.0.0.1:1", "--prompt", "a b c", "--max-new-tokens", "20000"], ["--max-new-tokens", "8,192"]),
    (["transfer", "serve", "--producer", "{M}/ref-attn", "--codec", "{M}/codec-ref-attn-ft", "--port", "70000"],
     ["port"]),
    (["transfer", "serve", "--producer", "{M}/ref-attn", "--codec", "{M}/codec-ref-attn-ft", "--threads", "0"],
     ["--threads"]),
    (["transfer", "bench", "--codec", "{M}/codec-ref-attn-ft", "--length", "100000"], ["max_position_embeddings"]),
])
def test_inputs_are_bounded_before_any_work(capsys, unchanged, tmp_path, args, needles):
    _refused(capsys, *[a.replace("{M}", str(unchanged)).replace("{T}", str(tmp_path)) for a in args], needles=needles)
    assert not any(tmp_path.iterdir())  # nothing was started


def test_result_files_take_appended_runs_only(tmp_path):
    legacy = tmp_path / "eval.json"
    legacy.write_text(json.dumps({"model": "m", "results": [{"score": 1.0}]}))
    check_results_out(legacy, overwrite=False)  # a result file from before provenance: runs are appended to it
    append_run(legacy, {"results": [{"score": 0.5}]}, {"commit": "x"})
    runs = read_runs(legacy)
    assert [r["results"][0]["score"] for r in runs] == [1.0, 0.5] and "provenance" not in runs[0]
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "qwen3"}))
    with pytest.raises(OutputError, match="not a kvstate result file"):
        check_results_out(config, overwrite=False)


def test_card_out_and_threads(tmp_path):
    card = tmp_path / "README.md"
    check_card_out(card, "Generated by x", overwrite=False)  # new
    card.write_text("Generated by x\n")
    check_card_out(card, "Generated by x", overwrite=False)  # its own
    card.write_text("hand-written\n")
    with pytest.raises(OutputError, match="not written by this card command"):
        check_card_out(card, "Generated by x", overwrite=False)
    from kvstate.errors import KVStateError

    for bad in (0, -1, True, 10**6):
        with pytest.raises(KVStateError, match="--threads"):
            set_threads(bad)


def test_semantic_eval_appends_to_a_committed_eval_json_and_keeps_every_run(capsys, scratch, tmp_path):
    router = tmp_path / "sekv"
    shutil.copytree(scratch / "ref-attn-sekv", router)
    before = read_runs(router / "eval.json")
    code, _, err = run_cli(capsys, "semantic", "eval", "--model", scratch / "ref-attn", "--router", router, "--task",
                           "niah_single", "--length", "128", "--n", "1", "--methods", "full", "--out",
                           router / "eval.json")
    assert code == 0, err
    after = read_runs(router / "eval.json")
    assert len(after) == len(before) + 1 and after[: len(before)] == before and "provenance" in after[-1]
    assert read_manifest(router, kind="router")  # the router's checksummed files are untouched
