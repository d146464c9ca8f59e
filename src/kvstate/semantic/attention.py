"""Mixed-resolution attention registered through transformers' ``AttentionInterface``.

The SEKV attention ("SEKV: Resolution-Adaptive Semantic KV Cache with Hierarchical Semantic Memory")
needs the query to decide which spans to zoom into, so it cannot live in the cache's ``update`` alone:
:class:`~kvstate.semantic.cache.SemanticLayer` hands itself to the attention call through the forward
kwargs, and the function registered here as ``"sekv"`` runs :meth:`SpanStore.attend` for a compressed
layer and plain SDPA otherwise (prefill runs at full resolution). :func:`semantic_attention` switches a
model to it for the duration of a ``with`` block and always switches back.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers import AttentionInterface

from kvstate.models.compat import (
    AttentionMaskInterface,
    attn_implementation,
    sdpa_attention_forward,
    sdpa_mask,
)

SEKV = "sekv"
LAYER_KWARG = "semantic_layer"


def sekv_attention_forward(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                           **kwargs: Any) -> tuple[torch.Tensor, None]:
    layer = kwargs.pop(LAYER_KWARG, None)
    if layer is None or layer.store is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"SEKV attention runs at batch size 1, got a batch of {query.shape[0]}")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = layer.attend(query, scale)  # (1, Hq, Tq, D)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Register ``"sekv"`` (idempotent): the attention function and SDPA's mask builder."""
    AttentionInterface.register(SEKV, sekv_attention_forward)
    AttentionMaskInterface.register(SEKV, sdpa_mask)


@contextmanager
def semantic_attention(model: Any) -> Iterator[Any]:
    """``with semantic_attention(model): model.generate(..., cache=SemanticCache(...))``."""
    register()
    old = attn_implementation(model.config)
    model.set_attn_implementation(SEKV)
    try:
        yield model
    finally:
        model.set_attn_implementation(old)
