"""Helpers of the bad-input tests: run the CLI's ``main`` in-process and fingerprint a directory tree."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from kvstate.cli import main

TINY = {"hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "num_kv_heads": 1, "log_every": 1,
        "tokens_per_step": 256, "max_batch": 4, "num_layers": 1, "max_steps": 1}


_TRAINED: list[Path] = []


def trained_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny attention model saved by ``kvstate.lab.training.train.train`` (one step), trained once per session.

    Tests copy it before damaging it; cached here so that every test module using it shares one run.
    """
    from kvstate.lab.training.train import TrainConfig, train

    if not _TRAINED:
        out = tmp_path_factory.mktemp("trained") / "tiny"
        train(TrainConfig(arch="attn", **TINY), out, progress=False, log=lambda s: None)
        _TRAINED.append(out)
    return _TRAINED[0]


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``kvstate ARGS`` through ``main`` (the console script's entry point)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main([str(a) for a in args])
    out, err = capsys.readouterr()
    code = exc.value.code
    return (code if isinstance(code, int) else (0 if code is None else 1)), out, err


def assert_one_line_exit_2(result: tuple[int, str, str], *needles: str) -> str:
    """Exit code 2, exactly one non-empty stderr line starting with ``error:``, no traceback, every needle in it."""
    code, _, err = result
    lines = [ln for ln in err.splitlines() if ln.strip() and "Loading weights" not in ln]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, (code, err)
    assert all(n in lines[0] for n in needles), (needles, lines[0])
    return lines[0]


def fingerprint(root: Path) -> dict[str, tuple[int, str, int]]:
    """Every path under ``root`` (hidden ones too) -> (size, sha256, mode): equal before and after = nothing changed."""
    out = {}
    for p in sorted(root.rglob("*")):
        st = p.stat()
        digest = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        out[str(p.relative_to(root))] = (st.st_size if p.is_file() else 0, digest, st.st_mode)
    return out
