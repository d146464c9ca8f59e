"""make reproduce covers every result file the report reads; retrain replays recorded parts into scratch only."""

import json
import re

import pytest

from kvstate.errors import KVStateError
from kvstate.lab.make import reproduce as R
from kvstate.lab.report.eval_section import reference_dirs
from kvstate.lab.training import retrain as T


def test_every_result_file_a_section_reads_has_a_job():
    arts = {j.artifact for j in R.jobs()}
    expected = {"models/ref-hybrid/prefix_replay.json", "models/ref-hybrid/prefix_tree_replay.json",
                *(f"models/ref-attn-sekv/{f}.json" for f in ("eval", "eval_sweep", "eval_bounds", "eval_4x", "eval_16x",
                                                              "decode")),
                "models/ref-hybrid-sekv/eval.json", "models/codec-ref-attn-ft/bench.json",
                "models/codec-ref-attn-ft/ttft.json",
                *(f"models/codec-ref-attn-ft2/{f}" for f in ("bench.json", "ttft.json")
                  if (R.REPO / "models/codec-ref-attn-ft2").is_dir()),  # the shifted pair, once trained
                *(f"models/{m}/depth_eval.json" for m in ("ref-attn", "ref-attn-norouting", "ref-attn-cla2",
                                                           "ref-attn-rcla", "ref-attn-rcla075", "ref-attn-kv1")),
                *(f"models/{m}/depth_decode.json" for m in ("ref-attn-rcla", "ref-attn-kv1")),
                *(f"models/{d.name}/reference_eval.json" for d in reference_dirs(R.REPO / "models"))}
    assert arts == expected
    for j in R.jobs():  # each command appends to the file it is the job of, on a test seed
        seeds = [int(x) for x in re.findall(r"--seed (\d+)", j.command)]
        assert j.artifact in j.command and len(seeds) == 1 and seeds[0] >= 1000, j.command


def test_dry_run_plans_without_running(capsys):
    out = R.reproduce(["depth"], dry_run=True)
    assert [name for name, _ in out] == [j.name for j in R.jobs() if j.name.startswith("depth:")]
    assert all(o in ("planned", "current") for _, o in out)
    with pytest.raises(KVStateError, match="no such job"):
        R.reproduce(["nope"], dry_run=True)


def test_the_plan_says_which_jobs_resume_from_a_journal(monkeypatch, tmp_path):
    from rich.console import Console

    monkeypatch.setattr(R, "REPO", tmp_path)
    job = R.Job("semantic:x", "models/m/eval.json", "kvstate semantic eval --out models/m/eval.json", 60.0)
    monkeypatch.setattr(R, "jobs", lambda: [job])
    (tmp_path / "models/m").mkdir(parents=True)
    (tmp_path / "models/m/.eval.json.journal").write_text('{"format": "kvstate-journal/1"}\n{"unit": "a"}\n{"unit": "b"}\n')
    con = Console(record=True, width=200)
    assert R.reproduce(["semantic"], dry_run=True, console=con) == [("semantic:x", "planned")]
    assert "resume (2 units journaled)" in con.export_text()


def _state(d, commands, step=100):
    d.mkdir(parents=True, exist_ok=True)
    (d / "training_state.json").write_text(json.dumps({"step": step, "seconds": 60.0, "commands": commands}))


def test_retrain_replays_into_scratch_and_refuses_unrecorded_runs(tmp_path):
    cmds = [{"command": "kvstate train --arch attn --out runs/a --minutes 5", "out": "runs/a", "resume": None,
             "from_step": 0},
            {"command": "kvstate train --arch attn --out runs/a2 --resume runs/a --minutes 5", "out": "runs/a2",
             "resume": "runs/a", "from_step": 50}]
    _state(tmp_path / "m", cmds)
    parts = T.plan(tmp_path / "m", scratch=tmp_path / "scratch")
    assert [p.from_step for p in parts] == [0, 50]
    assert all("runs/a" not in p.replay.split() and str(tmp_path / "scratch") in p.replay for p in parts)
    _state(tmp_path / "old", [])
    with pytest.raises(KVStateError, match="before training commands were recorded"):
        T.plan(tmp_path / "old")
    _state(tmp_path / "mid", [{**cmds[1], "resume": "runs/a2"}])
    with pytest.raises(KVStateError, match="not recorded"):
        T.plan(tmp_path / "mid")


def test_only_takes_a_comma_separated_list_or_repeats(monkeypatch):
    from typer.testing import CliRunner

    from kvstate.cli import app

    seen = []
    monkeypatch.setattr(R, "reproduce", lambda only, **kw: seen.append(list(only)) or [])
    runner = CliRunner()
    assert runner.invoke(app, ["lab", "reproduce", "--dry-run", "--only", "depth:ref-attn,transfer"]).exit_code == 0
    assert runner.invoke(app, ["lab", "reproduce", "--dry-run", "--only", "prefix", "--only", "depth"]).exit_code == 0
    assert seen == [["depth:ref-attn", "transfer"], ["prefix", "depth"]]
    bad = runner.invoke(app, ["lab", "reproduce", "--dry-run", "--only", "depth,,prefix"])
    assert bad.exit_code != 0 and isinstance(bad.exception, KVStateError) and "empty item" in str(bad.exception)
    assert len(seen) == 2  # refused before any job was planned


def test_retrain_reads_and_writes_only_recorded_parts_in_the_scratch_folder(tmp_path, capsys):
    from kvstate.cli import main

    a = {"command": "kvstate train --arch attn --out runs/a --minutes 5", "out": "runs/a", "resume": None, "from_step": 0}
    b = {"command": "kvstate train --arch attn --out runs/b --resume runs/a --minutes 5", "out": "runs/b",
         "resume": "runs/a", "from_step": 50}
    scratch = tmp_path / "scratch"
    _state(tmp_path / "m", [a, b])
    parts = T.plan(tmp_path / "m", scratch=scratch)  # each recorded output gets its own scratch folder
    assert [p.out for p in parts] == [scratch / "a", scratch / "b"]
    assert parts[1].replay.split()[-4:-2] == ["--resume", str(scratch / "a")]
    # part 2 resumed a hand-made copy (runs/a1) that no recorded part wrote: refused, naming it
    _state(tmp_path / "copied", [a, {**b, "command": b["command"].replace("runs/a ", "runs/a1 "), "resume": "runs/a1"}])
    with pytest.raises(KVStateError, match=r"part 2 resumes from runs/a1, which no earlier recorded part wrote.*"
                                           r"outside the scratch folder"):
        T.plan(tmp_path / "copied", scratch=scratch)
    with pytest.raises(SystemExit) as done:
        main(["lab", "retrain", str(tmp_path / "copied"), "--scratch", str(scratch), "--dry-run"])
    err = capsys.readouterr().err
    assert done.value.code == 2 and len(err.splitlines()) == 1 and "runs/a1" in err
    # a command whose --out is not its recorded output would write outside the scratch folder
    _state(tmp_path / "elsewhere", [{**a, "command": "kvstate train --arch attn --out /tmp/elsewhere"}])
    with pytest.raises(KVStateError, match="part 1 would write /tmp/elsewhere, outside the scratch folder"):
        T.plan(tmp_path / "elsewhere", scratch=scratch)
    with pytest.raises(KVStateError, match="overlaps the committed model"):
        T.plan(tmp_path / "m", scratch=tmp_path / "m" / "retrain")


def test_a_part_stopped_early_is_replayed_to_the_step_the_next_part_resumed_its_periodic_save(tmp_path):
    depth = "kvstate depth train --model models/ref-attn --out runs/d/player --p 0.5 --tokens {} --resume"
    cmds = [{"command": depth.format(4000)[:-len(" --resume")], "out": "runs/d/player", "resume": "models/ref-attn",
             "from_step": 100},
            {"command": depth.format(3000), "out": "runs/d/player", "resume": "runs/d/.player.partial", "from_step": 130},
            {"command": depth.format(100), "out": "runs/d/player", "resume": "runs/d/player", "from_step": 200},
            {"command": "kvstate train --arch attn --out runs/d/next --resume runs/d/.player.partial",
             "out": "runs/d/next", "resume": "runs/d/.player.partial", "from_step": 210}]
    (tmp_path / "models" / "ref-attn").mkdir(parents=True)
    scratch = tmp_path / "scratch"
    _state(tmp_path / "m", cmds[:3])
    parts = T.plan(tmp_path / "m", scratch=scratch)
    assert [p.stop_at_step for p in parts] == [130, None, None]
    assert parts[0].replay.split()[-2:] == ["--stop-at-step", "130"] and "--stop-at-step" not in parts[1].replay
    assert all(p.out == scratch / "player" for p in parts)  # its periodic saves, beside it, stay in the scratch folder
    # the next part cannot have resumed a periodic save from before the stopped part's first step
    _state(tmp_path / "inconsistent", [cmds[0], {**cmds[1], "from_step": 90}])
    with pytest.raises(KVStateError, match="part 2 resumes the periodic save of part 1 at step 90, not after"):
        T.plan(tmp_path / "inconsistent", scratch=scratch)
    # a --resume naming the periodic saves is swapped for the replay's own
    _state(tmp_path / "named", [cmds[0], cmds[3]])
    named = T.plan(tmp_path / "named", scratch=scratch)
    assert named[0].stop_at_step == 210
    assert named[1].replay.split()[-2:] == ["--resume", str(scratch / ".player.partial")]


def test_every_committed_model_with_a_recorded_training_can_be_replayed_or_its_card_says_why(tmp_path):
    states = sorted(p.parent for p in (R.REPO / "models").glob("*/training_state.json"))
    if not states:
        pytest.skip("no committed model with a recorded training state")
    replayed, refused = [], []
    for d in states:
        try:
            parts = T.plan(d, scratch=tmp_path / d.name)
        except KVStateError as exc:
            refused.append((d.name, str(exc), (d / "README.md").read_text() if (d / "README.md").is_file() else ""))
            continue
        assert parts and all(_inside(p.out, tmp_path / d.name) for p in parts)
        replayed.append(d.name)
    assert [name for name, _, card in refused if "cannot be replayed" not in card] == []
    if (R.REPO / "models" / "ref-attn-rcla" / "training_state.json").is_file():
        assert "ref-attn-rcla" in replayed  # the headline model: parts stopped early replay with --stop-at-step


def _inside(path, folder):
    return folder.resolve() in path.resolve().parents or path.resolve() == folder.resolve()
