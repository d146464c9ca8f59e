"""The depth fine-tunes' cards: training and curve from the exported record, the replay command with the run's
non-default settings, and only the card's own model (beside the reference) from the newest run of a result file."""

from __future__ import annotations

import json

import pytest

from kvstate.errors import KVStateError
from kvstate.lab.depth import rcla_test, realcard
from kvstate.lab.depth.realtrain import STATE


def _delta(tmp_path, pattern="cla2", steps=600, **config):
    from dataclasses import asdict

    from kvstate.lab.depth.realtrain import DepthFinetuneConfig

    d = tmp_path / "cla2-delta"
    d.mkdir()
    (d / "lora.safetensors").write_bytes(b"x" * 2_000_000)
    curve = [{"step": s, "tokens": s * 1000, "seconds": s * 16.0, "lr": 0.001, "prompt_kl": 1.0, "reply_kl": 0.2,
              "reply_ce": None if s == 5 else 0.1, "owners": 15.0} for s in range(5, steps + 1, 5)]
    state = {"config": asdict(DepthFinetuneConfig(pattern=pattern, steps=steps, **config)),
             "base": "models/smollm2-135m-instruct", "step": steps, "seconds": steps * 16.0, "tokens": steps * 1000,
             "curve": curve, "routing": None}
    (d / STATE).write_text(json.dumps(state))
    return d


def _result(path, seed, methods):
    rows = [{"method": m, "task": "niah_single", "length": 2048, "seed": seed, "n": 100, "value": v,
             "ci": [v - 0.05, v + 0.02]} for m, v in methods.items()]
    path.write_text(json.dumps({"format": "kvstate-results/1", "runs": [{"rows": [{**rows[0], "value": 0.0}]}, {"rows": rows}]}))


def test_the_card_reads_the_record_and_only_its_models_newest_scores(tmp_path, monkeypatch):
    d = _delta(tmp_path)
    monkeypatch.setitem(rcla_test.DELTAS, "cla2", d)
    res = tmp_path / "r.json"
    _result(res, 1069, {"base": 0.99, "rcla:keep@0.5": 0.9, "cla2:keep@0.5": 0.97, "cla2:top_shared@0.5": 0.01})
    text = realcard.card(d, [res, tmp_path / "absent.json"])
    assert "600 steps x 2 rows" in text and "600,000 tokens" in text and "2.67 h" in text and "2.0 MB" in text
    assert "train --pattern cla2 --steps 600 --out runs/depth/cla2" in text  # the non-default settings, replayable
    assert "export --run runs/depth/cla2 --out" in text and text.count("--overwrite") >= 1
    assert "outside the command line" not in text
    assert "cannot be replayed by `kvstate lab retrain`" in text  # what the reproducibility guard reads
    table = [ln for ln in text.splitlines() if ln.startswith("| ") and "niah_single" in ln]
    assert [ln.split(" | ")[0][2:] for ln in table] == ["base", "cla2:keep@0.5", "cla2:top_shared@0.5"]
    assert "0.970 [0.920, 0.990]" in text and "seed 1069" in text  # the newest run, not the first
    assert "**stale**: no provenance recorded" in text  # a file the report would mark stale is marked here too
    curve_rows = [ln for ln in text.splitlines() if ln.startswith("| ") and ln.split(" | ")[0][2:].isdigit()]
    assert curve_rows[-1].startswith("| 600 |") and 12 <= len(curve_rows) <= 14


def test_the_replay_command_uses_only_realtrains_options_and_names_the_rest(tmp_path, monkeypatch, capsys):
    from kvstate.lab.depth import realtrain

    with pytest.raises(SystemExit):
        realtrain.main(["train", "--help"])
    helptext = capsys.readouterr().out
    assert all(f"--{f.replace('_', '-')} " in helptext for f in realcard.CLI_FLAGS)  # every flag the card may print
    d = _delta(tmp_path, warmup=5, lr=0.001)
    monkeypatch.setitem(rcla_test.DELTAS, "cla2", d)
    text = realcard.card(d, [])
    assert "train --pattern cla2 --steps 600 --lr 0.001 --out" in text and "--warmup" not in text
    assert "set them in `DepthFinetuneConfig`: warmup=5" in text
    assert "| 5 | 5,000 | 0.02 | 0.001 | 1.0 | 0.2 | — |" in text  # a window without a reply: a dash, not None


def test_an_unscored_model_says_so_and_bad_deltas_are_refused(tmp_path, monkeypatch):
    d = _delta(tmp_path, pattern="family")
    monkeypatch.setitem(rcla_test.DELTAS, "rcla", d)
    text = realcard.card(d, [tmp_path / "absent.json"])
    assert "Not yet scored on a test seed" in text and "R-CLA over the declared keep-0.5 family" in text
    other = tmp_path / "other"
    other.mkdir()
    with pytest.raises(KVStateError, match="not a depth delta"):
        realcard.card(_delta(other))
    (d / STATE).unlink()
    with pytest.raises(KVStateError, match="export"):
        realcard.card(d)
