"""Torch glue of the radix store: KV segments owned by tree nodes, and rebuilding a cache from a path.

Sparse prefix caching ("Sparse Prefix Caching for Hybrid and Recurrent LLM Serving") with the KV
shared in a radix tree (RadixAttention's layout, "SGLang: Efficient Execution of Structured Language
Model Programs"): each node's payload is a :class:`KVSegment`, the keys/values of its edge's tokens only.
A segment is cut in two by copying each side into its own storage, so evicting one side frees its bytes.
Restoring concatenates the segments along a path and adds a recurrent state (a sparse checkpoint or an
end state), moving everything to the model's device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from kvstate.errors import KVStateError
from kvstate.models.compat import DynamicLayer
from kvstate.models.families import LayerKind
from kvstate.models.resumable import ResumableCache
from kvstate.models.state import CacheSnapshot, fill_cache


@dataclass(frozen=True)
class KVSegment:
    """Keys/values of tokens ``[start, start + length)`` for each attention layer (None elsewhere)."""

    layers: tuple[
        tuple[torch.Tensor, torch.Tensor] | None, ...
    ]  # per layer: (B, kv_heads, length, head_dim) ×2
    length: int

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for kv in self.layers if kv is not None for k, v in [kv])

    def split(self, k: int) -> tuple[KVSegment, KVSegment]:
        """The first ``k`` tokens and the rest, each copied into its own storage."""
        if not 0 < k < self.length:
            raise KVStateError(f"split at {k} must lie inside the segment (1..{self.length - 1}).")
        first = tuple(
            None if kv is None else (kv[0][..., :k, :].clone(), kv[1][..., :k, :].clone())
            for kv in self.layers
        )
        rest = tuple(
            None if kv is None else (kv[0][..., k:, :].clone(), kv[1][..., k:, :].clone())
            for kv in self.layers
        )
        return KVSegment(first, k), KVSegment(rest, self.length - k)


def split_segment(payload: Any, k: int) -> tuple[Any, Any]:
    """The store's splitter: cut a node's KV payload after ``k`` tokens."""
    if not isinstance(payload, KVSegment):
        raise KVStateError(f"expected a KVSegment payload, got {type(payload).__name__}.")
    return payload.split(k)


def kv_segment(
    cache: DynamicCache, start: int, end: int, kinds: list[LayerKind], device: Any = None
) -> KVSegment:
    """Copy the keys/values of positions ``[start, end)`` out of a live cache (onto ``device`` if given)."""
    layers: list[tuple[torch.Tensor, torch.Tensor] | None] = []
    for i, (layer, kind) in enumerate(zip(cache.layers, kinds, strict=True)):
        if kind not in (LayerKind.ATTENTION, LayerKind.HYBRID):
            layers.append(None)
            continue
        if (
            not isinstance(layer, DynamicLayer)
            or layer.keys is None
            or layer.values is None
            or layer.keys.shape[-2] < end
        ):
            held = getattr(getattr(layer, "keys", None), "shape", (0, 0))[-2]
            raise KVStateError(
                f"layer {i} holds {held} tokens of KV; tokens [{start}, {end}) were asked for."
            )
        keys = layer.keys[..., start:end, :]
        values = layer.values[..., start:end, :]
        if device is not None and torch.device(device) != keys.device:
            layers.append((keys.to(device), values.to(device)))
        else:
            layers.append((keys.clone(), values.clone()))
    return KVSegment(tuple(layers), end - start)


def to_device(snapshot: CacheSnapshot, device: Any) -> CacheSnapshot:
    return snapshot if device is None else snapshot.to(device)


def build_cache(
    config: Any,
    kinds: list[LayerKind],
    parts: list[tuple[Any, int]],
    state: CacheSnapshot | None,
    length: int,
    device: torch.device,
    live: DynamicCache | None = None,
) -> ResumableCache:
    """A fresh cache after ``length`` tokens: KV from ``parts`` (segment, tokens of it) or the first
    ``length`` positions of ``live``; recurrent state from ``state``."""
    if length == 0:
        return ResumableCache(config)
    kv: list[tuple[torch.Tensor, torch.Tensor] | None] = []
    states: list[tuple[torch.Tensor, torch.Tensor] | None] = []
    for i, kind in enumerate(kinds):
        if kind in (LayerKind.ATTENTION, LayerKind.HYBRID):
            if live is not None:
                src = live.layers[i]
                assert isinstance(src, DynamicLayer) and src.keys is not None and src.values is not None
                keys, values = src.keys[..., :length, :].clone(), src.values[..., :length, :].clone()
            else:
                ks, vs = [], []
                for seg, take in parts:
                    part = seg.layers[i]
                    ks.append(part[0][..., :take, :])
                    vs.append(part[1][..., :take, :])
                keys = torch.cat(ks, dim=-2).to(device)  # (B, kv_heads, length, head_dim): a fresh copy
                values = torch.cat(vs, dim=-2).to(device)
                if keys.shape[-2] != length:
                    raise KVStateError(f"the path's KV covers {keys.shape[-2]} tokens, not {length}.")
            kv.append((keys, values))
        else:
            kv.append(None)
        if kind in (LayerKind.RECURRENT, LayerKind.HYBRID):
            if state is None or state.length != length:
                raise KVStateError(f"no recurrent state at position {length} to restore.")
            rec = state.layers[i].recurrent
            assert rec is not None
            states.append((rec.conv.to(device, copy=True), rec.recurrent.to(device, copy=True)))
        else:
            states.append(None)
    return fill_cache(config, kinds, kv, states, length)
