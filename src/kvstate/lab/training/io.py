"""Saving and reading training runs so that nothing is lost: whole-or-nothing output directories.

Every save of :func:`kvstate.lab.training.train.train` builds the complete run directory (weights, tokenizer,
``optimizer.safetensors``, ``training_state.json``, and a checksum ``manifest.json``, see
:mod:`kvstate.integrity`) in a temporary sibling and renames it into place (:mod:`kvstate.io_safety`).
Periodic saves go to the hidden sibling :func:`partial_dir` of the output, the final save to the
output itself, so a run that fails or is interrupted leaves a previous output untouched and whole
and its own progress resumable from the partial directory. A model whose weights are not all
finite is never saved. Every reader of a ``training_state.json`` goes through :func:`read_state`, which
refuses a file that is not a JSON object, has a field of the wrong type (anywhere: curve points, recorded
commands, the depth record) or lacks a field the reader needs, with one :class:`TrainError` naming the file,
the field and the fix.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Sequence
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


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _num_map(v: Any) -> bool:
    return isinstance(v, dict) and all(isinstance(k, str) and _is_num(x) for k, x in v.items())


# what each field of a training state holds wherever it appears ("[]": every item of a list); a field a
# reader does not use may be absent, but one that is present has its type
_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "step": (_is_int, "an integer"), "tokens": (_is_int, "an integer"), "seconds": (_is_num, "a number"),
    "length": (_is_int, "an integer"), "params": (_is_int, "an integer"),
    "curve": (lambda v: isinstance(v, list), "a list"), "stages": (lambda v: isinstance(v, list), "a list"),
    "config": (lambda v: isinstance(v, dict), "an object"), "commands": (lambda v: isinstance(v, list), "a list"),
    "depth": (lambda v: isinstance(v, dict), "an object"),
    "curve[]": (lambda v: isinstance(v, dict), "an object"), "curve[].step": (_is_int, "an integer"),
    "curve[].tokens": (_is_int, "an integer"), "curve[].minutes": (_is_num, "a number"),
    "curve[].length": (_is_int, "an integer"), "curve[].loss": (_is_num, "a number"),
    "curve[].exact": (_num_map, "an object of numbers"), "curve[].first_token": (_num_map, "an object of numbers"),
    "commands[]": (lambda v: isinstance(v, dict), "an object"), "commands[].command": (lambda v: isinstance(v, str), "a string"),
    "commands[].out": (lambda v: isinstance(v, str), "a string"),
    "commands[].resume": (lambda v: v is None or isinstance(v, str), "a string or null"),
    "commands[].from_step": (_is_int, "an integer"),
    "depth.start": (lambda v: isinstance(v, str), "a string"), "depth.start_step": (_is_int, "an integer"),
    "depth.start_tokens": (_is_int, "an integer"), "depth.parts": (lambda v: isinstance(v, list), "a list"),
    "depth.parts[]": (lambda v: isinstance(v, dict), "an object"),
    "depth.parts[].draw_counts": (_num_map, "an object of numbers"),
    "config.arch": (lambda v: isinstance(v, str), "a string"),
    **{f"config.{k}": (_is_int, "an integer") for k in ("max_length", "warmup_steps", "tokens_per_step", "seed")},
    **{f"config.{k}": (_is_num, "a number") for k in ("lr", "shorter_share", "decay_fraction")},
    "config.answer_share": (lambda v: v is None or _is_num(v), "a number or null"),  # None: the default weighting
    "config.task_mix": (lambda v: v is None or _num_map(v), "an object of numbers or null"),  # None: the default mix
}


def _at(state: Any, path: str) -> list[tuple[str, Any]]:
    """Every (where, container) holding the last field of ``path``, e.g. each curve point for ``curve[].step``."""
    found: list[tuple[str, Any]] = [("", state)]
    for part in path.split(".")[:-1]:
        name, many = part.removesuffix("[]"), part.endswith("[]")
        nxt = []
        for where, obj in found:
            value = obj.get(name) if isinstance(obj, dict) else None
            if many and isinstance(value, list):
                nxt += [(f"{where}{name}[{i}].", item) for i, item in enumerate(value)]
            elif not many and isinstance(value, dict):
                nxt.append((f"{where}{name}.", value))
        found = nxt
    return found


def _check_state(state: Any, path: str | Path, need: Sequence[str] = ()) -> dict[str, Any]:
    """``state`` (read from ``path``) if it is a training state whose present fields have their types and which
    has every field in ``need`` (paths as in ``_FIELDS``, e.g. ``"curve[].step"``); else :class:`TrainError`."""
    fix = (f"restore it (git checkout -- {path} for a committed model, or copy it from the run directory that "
           "wrote it)")
    if not isinstance(state, dict):
        raise TrainError(f"{str(path)!r} is not a kvstate training state (a JSON {type(state).__name__}, not an "
                         f"object); {fix}")
    for field, (ok, kind) in _FIELDS.items():
        last = field.rsplit(".", 1)[-1]
        name, many = last.removesuffix("[]"), last.endswith("[]")
        for where, obj in _at(state, field):
            if not isinstance(obj, dict) or name not in obj:
                if field in need:
                    raise TrainError(f"{str(path)!r} is not a kvstate training state: {where}{name} is missing; {fix}")
                continue
            values = [(f"{where}{name}[{i}]", v) for i, v in enumerate(obj[name])] if many and isinstance(
                obj[name], list) else [(f"{where}{name}", obj[name])] if not many else []
            for at, value in values:
                if not ok(value):
                    raise TrainError(f"{str(path)!r} is not a kvstate training state: {at} is "
                                     f"{json.dumps(value)[:40]}, not {kind}; {fix}")
    return state


def read_state(path: str | Path, need: Sequence[str] = ()) -> dict[str, Any]:
    """The training state in the file ``path``, checked by :func:`_check_state`; :class:`TrainError` naming the file
    and the fix when it is unreadable, not JSON or malformed."""
    try:
        state = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise TrainError(f"{str(path)!r} is not a readable JSON training state ({type(exc).__name__}: {exc}); "
                         f"restore it (git checkout -- {path} for a committed model, or copy it from the run "
                         "directory that wrote it)") from None
    return _check_state(state, path, need)


def load_state(run_dir: str | Path) -> dict[str, Any]:
    """The ``training_state.json`` of a training output directory (one to resume from)."""
    path = Path(run_dir) / STATE_FILE
    if not path.is_file():
        raise TrainError(f"resume directory {str(run_dir)!r} has no {STATE_FILE}; pass a directory written by "
                         "kvstate train --out (an interrupted run's progress is in its .<name>.partial sibling)")
    state = read_state(path, ("step", "tokens", "seconds", "length", "curve", "stages", "config", "config.arch"))
    if min(state["step"], state["tokens"], state["seconds"]) < 0 or not 16 <= state["length"] <= 2**20:
        raise TrainError(f"{str(path)!r} is not a kvstate training state (negative step / tokens / seconds, or a "
                         "length outside 16..2^20); resume from an intact run directory")
    return state
