"""Loading local models and configs (offline only: nothing is fetched from a hub).

Errors name the path and the fix: a missing directory, a directory without ``config.json``, a config
that is not a causal LM, a family kvstate does not support.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from kvstate.errors import ModelLoadError
from kvstate.models.families import family_of, text_config


def load_config(path: str | Path) -> Any:
    """The config of a local model directory, checked to be a supported causal LM."""
    p = Path(path)
    if not p.exists():
        raise ModelLoadError(f"model path {str(p)!r} does not exist; pass a directory made by save_pretrained().")
    if not p.is_dir():
        raise ModelLoadError(f"model path {str(p)!r} is a file; pass the directory that holds config.json.")
    if not (p / "config.json").is_file():
        raise ModelLoadError(f"{str(p)!r} has no config.json; it is not a transformers model directory.")
    try:
        config = AutoConfig.from_pretrained(p, local_files_only=True)
    except (ValueError, OSError, KeyError) as exc:
        raise ModelLoadError(f"{str(p / 'config.json')!r} could not be read as a transformers config: {exc}") from exc
    tc = text_config(config)
    if tc.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ModelLoadError(
            f"{str(p)!r} holds a {config.model_type!r} config, which is not a causal language model; "
            "kvstate needs a decoder-only model (AutoModelForCausalLM)."
        )
    family_of(config)  # raises UnsupportedModelError naming the supported families
    return config


def load_model(path: str | Path, dtype: torch.dtype | None = None) -> Any:
    """``AutoModelForCausalLM.from_pretrained`` on a local directory, in eval mode."""
    config = load_config(path)
    kwargs: dict[str, Any] = {"local_files_only": True}
    if dtype is not None:
        kwargs["dtype"] = dtype
    try:
        model = AutoModelForCausalLM.from_pretrained(Path(path), config=config, **kwargs)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"weights in {str(path)!r} could not be loaded: {exc}") from exc
    return model.eval()
