"""Loading local models and configs (offline only: nothing is fetched from a hub), validated at the boundary.

Errors name the path and the fix: a missing directory, a directory without ``config.json``, a config
that is not JSON or not a causal LM, a family kvstate does not support, impossible config values
(:mod:`kvstate.models.config_check`), weights whose file is truncated or corrupted (safetensors header
check, and the checksum manifest ``kvstate train`` writes: :mod:`kvstate.integrity`), and weights that
do not cover the model exactly: transformers would initialise missing tensors at random and only log
its load report, which the CLI silences; here missing, unexpected or mis-shaped tensors are an error
whose message carries that report, and so are non-finite weights. Errors raised by safetensors,
transformers and huggingface_hub while reading are translated here into :class:`ModelLoadError`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from huggingface_hub.errors import StrictDataclassError
from safetensors import SafetensorError
from transformers import AutoConfig, AutoModelForCausalLM

from kvstate.errors import ModelConfigError, ModelLoadError
from kvstate.integrity import check_safetensors_header, verify_manifest
from kvstate.models.compat import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from kvstate.models.config_check import check_config, check_raw_config
from kvstate.models.families import family_of, text_config


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:400]


def load_config(path: str | Path) -> Any:
    """The config of a local model directory, checked to be a supported causal LM with sane values."""
    p = Path(path)
    if not p.exists():
        raise ModelLoadError(f"model path {str(p)!r} does not exist; pass a directory made by save_pretrained().")
    if not p.is_dir():
        raise ModelLoadError(f"model path {str(p)!r} is a file; pass the directory that holds config.json.")
    cfg_file = p / "config.json"
    if not cfg_file.is_file():
        raise ModelLoadError(f"{str(p)!r} has no config.json; it is not a transformers model directory.")
    try:
        raw = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelConfigError(f"{str(cfg_file)!r} could not be read as UTF-8 JSON ({_one_line(exc)}); restore it or re-save the "
                               "model with save_pretrained()") from None
    except OSError as exc:
        raise ModelLoadError(f"{str(cfg_file)!r} cannot be read ({exc.strerror or exc}); check its permissions") from None
    check_raw_config(raw, cfg_file)
    try:
        config = AutoConfig.from_pretrained(p, local_files_only=True)
    except (ValueError, OSError, KeyError, TypeError, StrictDataclassError) as exc:
        raise ModelConfigError(f"{str(cfg_file)!r} could not be read as a transformers config: {_one_line(exc)}; "
                               "fix the named field or re-save the model with save_pretrained()") from None
    tc = text_config(config)
    if tc.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ModelLoadError(
            f"{str(p)!r} holds a {config.model_type!r} config, which is not a causal language model; "
            "kvstate needs a decoder-only model (AutoModelForCausalLM)."
        )
    family_of(config)  # raises UnsupportedModelError naming the supported families
    check_config(config, where=str(cfg_file))
    return config


def _weight_files(p: Path) -> list[Path]:
    index = p / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as exc:
            raise ModelLoadError(f"{str(index)!r} is not a safetensors index ({_one_line(exc)}); restore it") from None
        return [p / s for s in shards]
    single = p / "model.safetensors"
    return [single] if single.is_file() else []


def _report(info: dict[str, Any]) -> str:
    parts = []
    for key, label in (("missing_keys", "missing"), ("unexpected_keys", "unexpected"), ("mismatched_keys", "mis-shaped")):
        names = sorted(str(k) for k in info.get(key) or [])
        if names:
            shown = ", ".join(names[:4]) + (f", … ({len(names)} in all)" if len(names) > 4 else "")
            parts.append(f"{len(names)} {label} ({shown})")
    return "; ".join(parts)


def load_model(path: str | Path, dtype: torch.dtype | None = None) -> Any:
    """``AutoModelForCausalLM.from_pretrained`` on a local directory, checked, in eval mode.

    Raises :class:`ModelLoadError` when a weight file is corrupt, does not match the directory's
    manifest, lacks tensors the model needs or holds ones it does not, or holds non-finite values.
    """
    p = Path(path)
    config = load_config(p)
    verify_manifest(p)
    files = _weight_files(p)
    if not files:
        raise ModelLoadError(f"{str(p)!r} holds no model.safetensors (or its index); save the weights with "
                             "save_pretrained() — kvstate loads safetensors only, never pickle")
    for f in files:
        if not f.is_file():
            raise ModelLoadError(f"weight shard {str(f)!r} named by the index is missing; restore it")
        check_safetensors_header(f)
    kwargs: dict[str, Any] = {"local_files_only": True, "output_loading_info": True, "use_safetensors": True}
    if dtype is not None:
        kwargs["dtype"] = dtype
    try:
        model, info = AutoModelForCausalLM.from_pretrained(p, config=config, **kwargs)
    except (OSError, ValueError, SafetensorError) as exc:
        raise ModelLoadError(f"weights in {str(p)!r} could not be loaded: {_one_line(exc)}; restore or re-save "
                             "them") from None
    except RuntimeError as exc:
        if "mismatch" not in str(exc):
            raise
        raise ModelLoadError(f"weights in {str(p)!r} do not fit its config.json (size mismatch): {_one_line(exc)}; "
                             "restore the matching weights or config") from None
    report = _report(info)
    if report:
        raise ModelLoadError(f"weights in {str(p)!r} do not match the model its config.json describes (transformers' "
                             f"load report: {report}); missing tensors would be random — restore the full "
                             "model.safetensors or re-save the model")
    for name, tensor in model.state_dict().items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ModelLoadError(f"weights in {str(p)!r} hold NaN or inf in {name!r}; the model is unusable — "
                                 "restore a good copy or retrain")
    return model.eval()


class MissingTokenizerError(ModelLoadError):
    """A model directory without the tokenizer files ``save_pretrained`` writes, or one that does not load."""


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def load_tokenizer(path: str | Path) -> Any:
    """The tokenizer saved next to a model (``tokenizer.json`` / ``tokenizer_config.json``), offline.

    The one loader the server and the lab share; a directory without one, or one that does not load, is one
    :class:`MissingTokenizerError` naming the fix.
    """
    from transformers import AutoTokenizer

    p = Path(path)
    if not any((p / f).is_file() for f in TOKENIZER_FILES):
        raise MissingTokenizerError(f"{str(p)!r} holds no tokenizer (tokenizer.json / tokenizer_config.json); save "
                                    "one with tokenizer.save_pretrained(DIR) next to the model")
    try:
        return AutoTokenizer.from_pretrained(p, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise MissingTokenizerError(f"the tokenizer in {str(p)!r} could not be loaded "
                                    f"({' '.join(str(exc).split())[:300]}); re-save it with "
                                    "tokenizer.save_pretrained(DIR)") from None
