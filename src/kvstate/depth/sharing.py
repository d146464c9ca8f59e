"""Cross-layer KV sharing at inference: :func:`apply_sharing` and the cache that stores only owners.

Deployment side of "Reducing Transformer Key-Value Cache Size with Cross-Layer Attention" and of
Random Cross-Layer Attention ("Stochastic KV Routing"): a fixed
:class:`~kvstate.depth.patterns.SharingPattern` is routed through every forward pass
(:func:`kvstate.depth.attention.routed`), so non-owner layers skip their K/V projections and read
their owner's K/V. The cache reuses transformers' own KV-sharing extension point (Gemma's
``kv_sharing_modes``): while :func:`apply_sharing` is active the config marks non-owner layers
``"reuse"``, so every ``DynamicCache(config=...)`` built from it (``generate`` builds one) holds a
``DummyLayer`` with no tensors there; :func:`sharing_cache` builds the same cache explicitly.
Ignored: sharing between a model's attention and recurrent state (recurrent layers are never shared).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers import DynamicCache

from kvstate.depth.attention import Router, layer_specs, routed
from kvstate.depth.patterns import SharingPattern
from kvstate.depth.patterns import kv_bytes as _kv_bytes
from kvstate.models.accounting import model_dtype
from kvstate.models.compat import DummyLayer
from kvstate.models.families import text_config

_MISSING = object()


def sharing_modes(pattern: SharingPattern) -> list[str]:
    """transformers' ``kv_sharing_modes``: ``reuse`` for non-owners, ``store`` for owners read by others."""
    read = set(pattern.sources)
    return ["reuse" if s != i else ("store" if i in read else "own") for i, s in enumerate(pattern.sources)]


def sharing_cache(config: Any, pattern: SharingPattern) -> DynamicCache:
    """A ``DynamicCache`` whose non-owner layers are ``DummyLayer`` (no tensors): K/V only for owners."""
    pattern.validate(layer_specs(config))
    cache = DynamicCache(config=config)
    for i, src in enumerate(pattern.sources):
        if src != i:
            cache.layers[i] = DummyLayer()
    return cache


def kv_bytes(pattern: SharingPattern, config: Any, dtype: torch.dtype | None = None) -> int:
    """Attention K/V bytes per token under ``pattern`` (``dtype``: the model's by default)."""
    itemsize = torch.empty(0, dtype=dtype or model_dtype(config)).element_size()
    return _kv_bytes(pattern, layer_specs(config), itemsize)


@contextmanager
def apply_sharing(model: Any, pattern: SharingPattern) -> Iterator[Router]:
    """Run ``model`` under a fixed sharing pattern until the block exits (works with ``generate``).

    Raises :class:`~kvstate.depth.patterns.PatternError` naming the layer and rule a bad pattern
    breaks. Caches built inside the block from ``model.config`` store K/V only for owner layers.
    """
    pattern.validate(layer_specs(model.config))
    tc = text_config(model.config)
    saved = tc.__dict__.get("kv_sharing_modes", _MISSING)
    tc.kv_sharing_modes = sharing_modes(pattern)
    try:
        with routed(model, lambda: pattern) as router:
            yield router
    finally:
        if saved is _MISSING:
            tc.__dict__.pop("kv_sharing_modes", None)
        else:
            tc.kv_sharing_modes = saved


__all__ = ["apply_sharing", "kv_bytes", "sharing_cache", "sharing_modes"]
