"""Model families kvstate supports, and the kind of state each decoder layer carries.

This is the one module that maps a transformers config onto kvstate's view of a model: which layers hold
attention KV, which hold recurrent (conv + SSM / linear-attention) state, which hold both (Falcon-H1), and
the chunk size of the torch-fallback chunked kernel (a checkpoint inside a prefix is cheapest to capture
at a chunk boundary — sparse prefix caching). Anything not listed here raises :class:`UnsupportedModelError`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from kvstate.errors import UnsupportedModelError


class LayerKind(StrEnum):
    ATTENTION = "attention"  # per-token keys/values (DynamicLayer)
    RECURRENT = "recurrent"  # conv state + recurrent state, O(1) in sequence length
    HYBRID = "hybrid"  # both in one layer (Falcon-H1)
    NONE = "none"  # no cached state (MLP-only)


class RecurrentKind(StrEnum):
    GATED_DELTANET = "gated_deltanet"  # Qwen3.5 / Qwen3-Next linear attention
    MAMBA2 = "mamba2"  # Mamba2 SSD (Mamba2, Bamba, Falcon-H1, NemotronH)


@dataclass(frozen=True)
class Family:
    name: str  # human name, e.g. "Qwen3.5"
    model_types: tuple[str, ...]  # transformers `model_type` values of the text config
    recurrent: RecurrentKind | None  # None: attention only


FAMILIES: tuple[Family, ...] = (
    Family("Llama", ("llama",), None),
    Family("Qwen3", ("qwen3",), None),
    Family("Qwen3.5", ("qwen3_5_text", "qwen3_5"), RecurrentKind.GATED_DELTANET),
    Family("Qwen3-Next", ("qwen3_next",), RecurrentKind.GATED_DELTANET),
    Family("Mamba2", ("mamba2",), RecurrentKind.MAMBA2),
    Family("Bamba", ("bamba",), RecurrentKind.MAMBA2),
    Family("Falcon-H1", ("falcon_h1",), RecurrentKind.MAMBA2),
)

_BY_TYPE = {t: f for f in FAMILIES for t in f.model_types}

# transformers `layer_types` entries → kvstate layer kinds.
_LAYER_TYPE_KIND = {
    "full_attention": LayerKind.ATTENTION,
    "linear_attention": LayerKind.RECURRENT,
    "hybrid": LayerKind.HYBRID,
    "dummy": LayerKind.NONE,
    "mlp": LayerKind.NONE,
    "moe": LayerKind.NONE,
}


def supported_families() -> str:
    return ", ".join(f"{f.name} ({'/'.join(f.model_types)})" for f in FAMILIES)


def text_config(config: Any) -> Any:
    """The decoder text config (multimodal wrappers such as Qwen3.5's carry it as `text_config`)."""
    return config.get_text_config(decoder=True)


def family_of(config: Any) -> Family:
    tc = text_config(config)
    family = _BY_TYPE.get(getattr(tc, "model_type", ""))
    if family is None:
        raise UnsupportedModelError(
            f"model_type {getattr(tc, 'model_type', None)!r} is not supported by kvstate; "
            f"supported families: {supported_families()}."
        )
    return family


def layer_kinds(config: Any) -> list[LayerKind]:
    """One kind per decoder layer, in order."""
    family_of(config)
    tc = text_config(config)
    types = getattr(tc, "layer_types", None)
    if types is None:  # Llama and other attention-only configs carry no layer_types
        return [LayerKind.ATTENTION] * tc.num_hidden_layers
    kinds = []
    for i, t in enumerate(types):
        if t not in _LAYER_TYPE_KIND:
            raise UnsupportedModelError(
                f"layer {i} has layer type {t!r}, which kvstate cannot snapshot; "
                f"known types: {sorted(_LAYER_TYPE_KIND)}."
            )
        kinds.append(_LAYER_TYPE_KIND[t])
    return kinds


def chunk_size(config: Any) -> int | None:
    """Chunk length of the model's torch-fallback chunked scan; None for attention-only models.

    Gated DeltaNet has no config field: the chunk length is the default argument of the modeling
    module's `torch_chunk_gated_delta_rule` (64 in transformers 5.24 / 5.25), read behind its kernel wrappers
    from the function that runs (:func:`kvstate.models.compat.gated_deltanet_chunk_size`).
    """
    family = family_of(config)
    tc = text_config(config)
    if family.recurrent is None:
        return None
    if family.recurrent is RecurrentKind.GATED_DELTANET:
        from kvstate.models.compat import gated_deltanet_chunk_size

        return gated_deltanet_chunk_size(tc.model_type)
    for field in ("mamba_chunk_size", "chunk_size"):
        value = getattr(tc, field, None)
        if isinstance(value, int) and value > 0:
            return value
    raise UnsupportedModelError(f"{family.name} config has no chunk size field (mamba_chunk_size / chunk_size).")

