"""Saving and reading training runs so that nothing is lost: whole-or-nothing output directories.

Every save of :func:`kvstate.lab.training.train.train` builds the complete run directory (weights, tokenizer,
``optimizer.safetensors``, ``training_state.json``, and a checksum ``manifest.json``, see
:mod:`kvstate.integrity`) in a temporary sibling and renames it into place (:mod:`kvstate.io_safety`).
Periodic saves go to the hidden sibling :func:`partial_dir` of the output, the final save to the
output itself, so a run that fails or is interrupted leaves a previous output untouched and whole
and its own progress resumable from the partial directory. A model whose weights are not all
finite is never saved.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from kvstate.errors import KVStateError
from kvstate.integrity import write_manifest
from kvstate.io_safety import staged_dir
from kvstate.lab.training.optim_io import save_optimizer

STATE_FILE, OPTIM_FILE = "training_state.json", "optimizer.safetensors"  # safetensors: never pickle


class TrainError(KVStateError):
    """A training run cannot start or continue: bad config, a resume directory that is not a training
    output, an output that would overwrite earlier work, or a loss / weights that became non-finite."""


def partial_dir(out: Path) -> Path:
    """Where periodic saves of a run writing ``out`` live until the run completes: ``.<name>.partial``."""
    return out.parent / f".{out.name}.partial"


def check_finite(model: Any, what: str) -> None:
    """Raise :class:`TrainError` naming the first parameter holding NaN or inf."""
    for name, p in model.named_parameters():
        if not bool(torch.isfinite(p).all()):
            raise TrainError(f"{what}: parameter {name!r} holds NaN or inf, so the model is not saved; lower "
                             "--set lr=... (or check the other --set values) and train again")


def save_run(model: Any, tokenizer: Any, optimizer: Any, dest: Path, state: dict[str, Any]) -> None:
    """Write a complete, resumable run directory to ``dest`` whole (temp sibling + rename); never NaN weights."""
    check_finite(model, f"saving {str(dest)!r}")
    with staged_dir(dest) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        save_optimizer(optimizer, tmp / OPTIM_FILE)
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=1))
        write_manifest(tmp)


def drop_partial(out: Path) -> None:
    shutil.rmtree(partial_dir(out), ignore_errors=True)


def load_state(run_dir: str | Path) -> dict[str, Any]:
    """The ``training_state.json`` of a training output directory."""
    path = Path(run_dir) / STATE_FILE
    if not path.is_file():
        raise TrainError(f"resume directory {str(run_dir)!r} has no {STATE_FILE}; pass a directory written by "
                         "kvstate train --out (an interrupted run's progress is in its .<name>.partial sibling)")
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
        kinds = {"step": int, "tokens": int, "seconds": (int, float), "length": int, "curve": list, "stages": list,
                 "config": dict}
        for key, kind in kinds.items():
            if not isinstance(state[key], kind) or isinstance(state[key], bool):
                raise TypeError(f"{key}={state[key]!r}")
        if min(state["step"], state["tokens"], state["seconds"]) < 0 or not 16 <= state["length"] <= 2**20:
            raise ValueError("negative step / tokens / seconds, or a length outside 16..2^20")
        if not isinstance(state["config"].get("arch"), str):
            raise KeyError("config.arch")
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as exc:
        raise TrainError(f"{str(path)!r} is not a kvstate training state ({type(exc).__name__}: {exc}); resume from "
                         "an intact run directory") from None
    return state
