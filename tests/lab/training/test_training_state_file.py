"""Every reader of a ``training_state.json`` refuses a malformed one with one error naming the file and the fix:
not a JSON object, a field of the wrong type (top level or nested), fields missing."""

import copy
import json
from pathlib import Path

import pytest

from kvstate.errors import KVStateError
from kvstate.lab.depth import section as depth_section
from kvstate.lab.report import eval_section
from kvstate.lab.training.io import load_state

POINT = {"step": 10, "tokens": 100, "minutes": 1.0, "length": 64, "loss": 1.5, "exact": {"niah_single": 0.5,
         "niah_multikey": 0.25}, "first_token": {"niah_single": 0.5}}
VALID = {
    "step": 100, "tokens": 1000, "seconds": 60.0, "length": 64, "curve": [POINT], "stages": [],
    "config": {"arch": "attn", "max_length": 64, "lr": 0.001, "warmup_steps": 1, "tokens_per_step": 100, "seed": 0,
               "shorter_share": 0.1, "decay_fraction": 0.1, "answer_share": 0.5, "task_mix": {"qa": 1}},
    "commands": [{"command": "kvstate train --arch attn --out runs/a", "out": "runs/a", "resume": None,
                  "from_step": 0}],
    "depth": {"start": "models/ref-attn", "start_step": 0, "start_tokens": 0, "p": 0.5,
              "parts": [{"to_step": 100, "tokens": 1000, "draw_counts": {"0_0": 1}}]},
}


def _missing(s: dict) -> dict:
    for key in ("seconds", "tokens", "config"):
        del s[key]
    for key in ("step", "minutes", "exact", "loss", "tokens"):
        del s["curve"][0][key]
    del s["commands"][0]["from_step"]
    del s["depth"]["start_step"], s["depth"]["start_tokens"]
    return s


SHAPES = {
    "not an object": lambda s: [s],
    "a string where a number is": lambda s: {**s, "step": "100"},
    "a list where an object is": lambda s: {**s, "config": ["arch", "attn"]},
    "a nested field of the wrong type": lambda s: {**s, "curve": [{**POINT, "exact": [0.5]}]},
    "a recorded command of the wrong type": lambda s: {**s, "commands": [{**s["commands"][0], "from_step": "0"}]},
    "fields missing": _missing,
}


def _cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    from kvstate.cli import main

    with pytest.raises(SystemExit) as done:
        main(args)
    return int(done.value.code or 0), capsys.readouterr().err


def _write(d: Path, state: object) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "training_state.json").write_text(json.dumps(state))
    return d / "training_state.json"


def _library_readers(root: Path) -> dict:
    """The readers that are functions (the report's), each given the model directory ``root / name``."""
    return {
        "resume (load_state)": lambda d: load_state(d),
        "report learning curves": lambda d: eval_section.curve_figure([d], root),
        "depth pilot curve": lambda d: depth_section._pilot(d.parent, root),
        "depth tokens": lambda d: depth_section._trained_tokens(d.parent, d.name),
        "depth curves": lambda d: depth_section._curves(d.parent, root),
    }


@pytest.mark.parametrize("shape", list(SHAPES))
def test_every_library_reader_refuses_a_malformed_state(tmp_path: Path, shape: str) -> None:
    d = tmp_path / "models" / depth_section.SPECIALIST  # a name every depth-section reader looks at
    for name, read in _library_readers(tmp_path).items():
        _write(d, VALID)
        read(d)  # the valid state is read
        path = _write(d, SHAPES[shape](copy.deepcopy(VALID)))
        with pytest.raises(KVStateError) as err:
            read(d)
        assert str(path) in str(err.value) and "git checkout" in str(err.value), name


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("command", ["lab retrain", "depth card"])
def test_every_cli_reader_refuses_a_malformed_state_in_one_line(tmp_path: Path, shape: str, command: str,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "m"
    args = ["lab", "retrain", str(d), "--scratch", str(tmp_path / "scratch"), "--dry-run"] \
        if command == "lab retrain" else ["depth", "card", "--model", str(d)]
    _write(d, VALID)
    assert _cli(args, capsys)[0] == 0  # the valid state is read
    path = _write(d, SHAPES[shape](copy.deepcopy(VALID)))
    code, err = _cli(args, capsys)
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("error: ") and str(path) in err
    assert "Traceback" not in err


@pytest.mark.parametrize("shape", list(SHAPES))
def test_the_transfer_card_refuses_a_malformed_state(tmp_path: Path, shape: str) -> None:
    from kvstate.lab.transfer.card import consumer_card

    _write(tmp_path / "base", VALID)
    path = _write(tmp_path / "ft", SHAPES[shape](copy.deepcopy(VALID)))
    with pytest.raises(KVStateError) as err:
        consumer_card(tmp_path / "ft", tmp_path / "base", None, "kvstate train ...")
    assert str(path) in str(err.value) and "git checkout" in str(err.value)
