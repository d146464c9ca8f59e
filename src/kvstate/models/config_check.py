"""Validating a model config at the boundary: positive dimensions, consistent layer lists, known dtypes.

transformers accepts ``num_attention_heads = -4`` or a ``layer_types`` list shorter than the layer count,
and a config's ``dtype`` naming no torch dtype fails deep inside it; kvstate's byte accounting would
then report negative or wrong sizes. These checks run when a config is loaded or described, before
anything is allocated, and raise :class:`~kvstate.errors.ModelConfigError` naming the field.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kvstate.errors import ModelConfigError
from kvstate.models.families import text_config

# Every size field a supported family reads; checked where present and not None.
DIMENSIONS = (
    "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "intermediate_size", "vocab_size", "max_position_embeddings", "linear_num_key_heads",
    "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim",
    "expand", "n_groups", "state_size", "num_heads", "conv_kernel", "mamba_n_groups", "mamba_d_state",
    "mamba_n_heads", "mamba_d_head", "mamba_d_conv", "mamba_expand", "mamba_d_ssm", "mamba_chunk_size",
    "chunk_size",
)
MAX_DIMENSION = 2**31 - 1  # int32 index range: larger sizes are typos, and would need absurd memory


def _dtype_ok(value: Any) -> bool:
    if value is None or isinstance(value, torch.dtype):
        return True
    if isinstance(value, str):
        if value == "auto":
            return True
        dt = getattr(torch, value.removeprefix("torch."), None)
        return isinstance(dt, torch.dtype) and dt.is_floating_point
    return False


def check_raw_config(raw: Any, where: str | Path) -> None:
    """Checks on the parsed ``config.json`` that transformers would otherwise fail on obscurely."""
    if not isinstance(raw, dict):
        raise ModelConfigError(f"{str(where)!r} holds a JSON {type(raw).__name__}, not an object; re-save the "
                               "model with save_pretrained()")
    for holder, label in ((raw, ""), (raw.get("text_config"), "text_config.")):
        if not isinstance(holder, dict):
            continue
        for key in ("dtype", "torch_dtype"):
            if key in holder and not _dtype_ok(holder[key]):
                raise ModelConfigError(f"{str(where)!r}: {label}{key}={holder[key]!r} is not a torch floating "
                                       "dtype; use float32, bfloat16 or float16")


def check_config(config: Any, where: str = "config") -> None:
    """Raise :class:`ModelConfigError` for non-positive or absurd dimensions, inconsistent heads or layer lists."""
    tc = text_config(config)
    for name in DIMENSIONS:
        value = getattr(tc, name, None)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_DIMENSION:
            raise ModelConfigError(f"{where}: {name}={value!r} must be a positive int (at most {MAX_DIMENSION:,}); "
                                   "fix config.json")
    heads, kv = getattr(tc, "num_attention_heads", None), getattr(tc, "num_key_value_heads", None)
    if heads and kv and heads % kv:
        raise ModelConfigError(f"{where}: num_attention_heads={heads} must be a multiple of num_key_value_heads={kv}; "
                               "fix config.json")
    types = getattr(tc, "layer_types", None)
    n = getattr(tc, "num_hidden_layers", None)
    if types is not None and n is not None and len(types) != n:
        raise ModelConfigError(f"{where}: layer_types lists {len(types)} layers but num_hidden_layers={n}; "
                               "make them agree")
    for holder in (config, tc):
        if not _dtype_ok(getattr(holder, "dtype", None)):
            raise ModelConfigError(f"{where}: dtype={holder.dtype!r} is not a torch floating dtype; use float32, "
                                   "bfloat16 or float16")
