"""Optimizer state on disk as safetensors (never pickle), so a training run can be resumed.

AdamW's per-parameter tensors are stored under ``"<param index>.<name>"``; the param groups (plain
numbers) go in the file's metadata as JSON.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

from kvstate.errors import InputFileError


def save_optimizer(optimizer: Any, path: Path) -> None:
    """AdamW state as safetensors: tensors keyed ``"<param index>.<name>"``, param groups in the metadata."""
    from safetensors.torch import save_file

    sd = optimizer.state_dict()
    tensors = {f"{i}.{k}": v.detach().contiguous() for i, st in sd["state"].items() for k, v in st.items()}
    save_file(tensors, str(path), metadata={"param_groups": json.dumps(sd["param_groups"])})


def load_optimizer(path: Path) -> dict[str, Any]:
    """The optimizer state saved by :func:`save_optimizer`; :class:`InputFileError` when the file is corrupt."""
    try:
        return _load(path)
    except (SafetensorError, KeyError, ValueError, TypeError, OSError) as exc:
        raise InputFileError(f"optimizer state {str(path)!r} is corrupt or not kvstate's ({type(exc).__name__}: "
                             f"{exc}); resume from an intact run directory") from None


def _load(path: Path) -> dict[str, Any]:
    from safetensors import safe_open

    state: dict[int, dict[str, torch.Tensor]] = {}
    with safe_open(str(path), framework="pt") as f:
        groups = json.loads(f.metadata()["param_groups"])
        for g in groups:  # JSON has no tuples; torch keeps betas as one
            if isinstance(g.get("betas"), list):
                g["betas"] = tuple(g["betas"])
        for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            idx, name = key.split(".", 1)
            state.setdefault(int(idx), {})[name] = f.get_tensor(key)
    return {"state": state, "param_groups": groups}
