"""Byte accounting of a model's state, from its config alone (no weights needed).

Seed 000's motivation in numbers: a recurrent checkpoint costs a fixed block of bytes (per head
``d_k * d_v`` for Gated DeltaNet, ``d_head * d_state`` for Mamba2, always fp32 in transformers) while
attention KV grows per token. ``tests/test_accounting.py`` checks every formula here against the bytes
of a real cache after a forward pass, for every supported family.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvstate.models.config_check import check_config
from kvstate.models.families import LayerKind, RecurrentKind, chunk_size, family_of, layer_kinds, text_config

RECURRENT_STATE_DTYPE = torch.float32  # transformers keeps SSM / delta-rule states in fp32 even in bf16 models


@dataclass(frozen=True)
class RecurrentShape:
    conv_channels: int  # conv state (B, conv_channels, conv_kernel)
    conv_kernel: int
    heads: int  # recurrent state (B, heads, dim_a, dim_b)
    dim_a: int
    dim_b: int


def recurrent_shape(config: Any) -> RecurrentShape | None:
    family = family_of(config)
    tc = text_config(config)
    if family.recurrent is RecurrentKind.GATED_DELTANET:
        key_dim = tc.linear_num_key_heads * tc.linear_key_head_dim
        value_dim = tc.linear_num_value_heads * tc.linear_value_head_dim
        return RecurrentShape(
            conv_channels=2 * key_dim + value_dim,
            conv_kernel=tc.linear_conv_kernel_dim,
            heads=tc.linear_num_value_heads,
            dim_a=tc.linear_key_head_dim,
            dim_b=tc.linear_value_head_dim,
        )
    if family.recurrent is RecurrentKind.MAMBA2:
        if tc.model_type == "mamba2":
            inner, groups, state, heads, head_dim, kernel = (
                tc.expand * tc.hidden_size, tc.n_groups, tc.state_size, tc.num_heads, tc.head_dim, tc.conv_kernel,
            )
        else:  # Bamba, Falcon-H1 name the same quantities mamba_*
            inner = getattr(tc, "mamba_d_ssm", None) or tc.mamba_expand * tc.hidden_size
            groups, state, heads, head_dim, kernel = (
                tc.mamba_n_groups, tc.mamba_d_state, tc.mamba_n_heads, tc.mamba_d_head, tc.mamba_d_conv,
            )
        return RecurrentShape(inner + 2 * groups * state, kernel, heads, head_dim, state)
    return None


def _dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def model_dtype(config: Any) -> torch.dtype:
    dtype = getattr(text_config(config), "dtype", None) or getattr(config, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def kv_token_bytes(kv_heads: int, head_dim: int, dtype_bytes: int, layers: int = 1) -> int:
    """K and V bytes one token adds to ``layers`` attention layers: ``layers × 2 × kv_heads × head_dim × dtype_bytes``.

    The one per-token KV formula: :func:`kv_bytes_per_token` (from a model config) and every method or report
    that sizes a raw KV cache use it.
    """
    return int(layers) * 2 * int(kv_heads) * int(head_dim) * int(dtype_bytes)


def kv_bytes_per_token(config: Any, dtype: torch.dtype | None = None) -> int:
    """Attention KV bytes one token adds to the cache (all attention and hybrid layers, batch 1)."""
    tc = text_config(config)
    dtype = dtype or model_dtype(config)
    n_attn = sum(k in (LayerKind.ATTENTION, LayerKind.HYBRID) for k in layer_kinds(config))
    if n_attn == 0:
        return 0
    head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
    kv_heads = getattr(tc, "num_key_value_heads", None) or tc.num_attention_heads
    return kv_token_bytes(kv_heads, head_dim, _dtype_bytes(dtype), n_attn)


def checkpoint_bytes(config: Any, dtype: torch.dtype | None = None) -> int:
    """Bytes of one recurrent checkpoint: conv + recurrent state of every recurrent/hybrid layer (batch 1)."""
    shape = recurrent_shape(config)
    if shape is None:
        return 0
    dtype = dtype or model_dtype(config)
    n_rec = sum(k in (LayerKind.RECURRENT, LayerKind.HYBRID) for k in layer_kinds(config))
    conv = shape.conv_channels * shape.conv_kernel * _dtype_bytes(dtype)
    rec = shape.heads * shape.dim_a * shape.dim_b * _dtype_bytes(RECURRENT_STATE_DTYPE)
    return n_rec * (conv + rec)


@dataclass(frozen=True)
class StateInfo:
    family: str  # kvstate family name
    layer_kinds: list[str]  # one of attention / recurrent / hybrid / none per decoder layer
    dtype: str  # dtype the accounting assumed for KV and conv state
    kv_bytes_per_token: int  # attention KV added per token
    checkpoint_bytes: int  # one recurrent checkpoint (0 for attention-only models)
    checkpoint_tokens: float | None  # checkpoint_bytes / kv_bytes_per_token; None without attention KV
    chunk_size: int | None  # chunked-kernel length (None: attention only)

    def as_json(self) -> dict[str, Any]:
        return {
            "family": self.family,
            "layer_kinds": self.layer_kinds,
            "dtype": self.dtype,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "checkpoint_bytes": self.checkpoint_bytes,
            "checkpoint_tokens": self.checkpoint_tokens,
            "chunk_size": self.chunk_size,
        }


def cache_nbytes(cache: Any) -> int:
    """Bytes of every tensor a cache holds, measured (its layers' attributes, including lists / dicts of tensors).

    The one meaning of a cache's ``nbytes`` across kvstate: what is held, not a formula; compare
    :func:`kv_bytes_per_token` / :func:`checkpoint_bytes`, which predict it from the config."""
    def walk(obj: Any, depth: int = 0) -> int:
        if isinstance(obj, torch.Tensor):
            return obj.nbytes
        if depth > 2:
            return 0
        if isinstance(obj, (list, tuple)):
            return sum(walk(v, depth + 1) for v in obj)
        if isinstance(obj, dict):
            return sum(walk(v, depth + 1) for v in obj.values())
        return 0

    layers = getattr(cache, "layers", None)
    holders = layers if layers is not None else [cache]
    return sum(walk(v) for layer in holders for v in vars(layer).values())


def describe(config: Any, dtype: torch.dtype | None = None) -> StateInfo:
    """The state accounting of a config; :class:`~kvstate.errors.ModelConfigError` for impossible values."""
    family_of(config)  # an unsupported family is named before its fields are checked
    check_config(config)
    dtype = dtype or model_dtype(config)
    kv = kv_bytes_per_token(config, dtype)
    ck = checkpoint_bytes(config, dtype)
    return StateInfo(
        family=family_of(config).name,
        layer_kinds=[k.value for k in layer_kinds(config)],
        dtype=str(dtype).removeprefix("torch."),
        kv_bytes_per_token=kv,
        checkpoint_bytes=ck,
        checkpoint_tokens=ck / kv if kv else None,
        chunk_size=chunk_size(config),
    )
