"""The one state contract for every per-layer state, over transformers' unified ``DynamicCache``.

A :class:`CacheSnapshot` is a detached copy of a cache at one sequence position: per decoder layer an
:class:`AttentionState` (keys/values), a :class:`RecurrentState` (conv + recurrent state), both (hybrid
layers), or nothing. Every part has ``nbytes``; attention parts slice to any shorter length. Restoring
builds a fresh ``DynamicCache(config=...)`` and fills it through the layers' own update methods.
A layer that reads another layer's KV (cross-layer sharing: a ``DummyLayer``) snapshots as empty and restores as one.

transformers updates states in place, so we clone on snapshot *and* on restore: a snapshot is never
aliased by a live cache. Seed 000 needs exactly this: dense attention KV for a whole prefix combined
with the recurrent state of a sparse checkpoint ``c`` (KV sliced to ``c``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from kvstate.errors import KVStateError
from kvstate.models.compat import (
    DummyLayer,
    DynamicLayer,
    LinearAttentionCacheLayerMixin,
    set_recurrent_length,
)
from kvstate.models.families import LayerKind, layer_kinds
from kvstate.models.resumable import ResumableCache


@dataclass(frozen=True)
class AttentionState:
    keys: torch.Tensor  # (B, kv_heads, T, head_dim)
    values: torch.Tensor  # (B, kv_heads, T, head_dim)

    @property
    def length(self) -> int:
        return int(self.keys.shape[-2])

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def sliced(self, length: int) -> AttentionState:
        """The first ``length`` positions (a view; clone before writing)."""
        return AttentionState(self.keys[..., :length, :], self.values[..., :length, :])

    def clone(self) -> AttentionState:
        return AttentionState(self.keys.clone(), self.values.clone())

    def to(self, device: torch.device | str) -> AttentionState:
        return AttentionState(self.keys.to(device), self.values.to(device))


@dataclass(frozen=True)
class RecurrentState:
    conv: torch.Tensor  # (B, conv_channels, conv_kernel)
    recurrent: torch.Tensor  # (B, heads, dim_a, dim_b), fp32

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.recurrent.nbytes

    def clone(self) -> RecurrentState:
        return RecurrentState(self.conv.clone(), self.recurrent.clone())

    def to(self, device: torch.device | str) -> RecurrentState:
        return RecurrentState(self.conv.to(device), self.recurrent.to(device))


@dataclass(frozen=True)
class LayerSnapshot:
    kind: LayerKind
    attention: AttentionState | None = None  # set for attention / hybrid layers (unless dropped)
    recurrent: RecurrentState | None = None  # set for recurrent / hybrid layers (unless dropped)

    @property
    def nbytes(self) -> int:
        return (self.attention.nbytes if self.attention else 0) + (self.recurrent.nbytes if self.recurrent else 0)


@dataclass(frozen=True)
class CacheSnapshot:
    """Detached copy of a cache's state after the first ``length`` tokens."""

    length: int  # tokens the state covers
    layers: tuple[LayerSnapshot, ...]
    has_attention: bool = field(default=True)  # False: attention parts dropped (a recurrent-only checkpoint)
    has_recurrent: bool = field(default=True)  # False: recurrent parts dropped (KV only)

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    @property
    def attention_nbytes(self) -> int:
        return sum(layer.attention.nbytes for layer in self.layers if layer.attention)

    @property
    def recurrent_nbytes(self) -> int:
        return sum(layer.recurrent.nbytes for layer in self.layers if layer.recurrent)

    def recurrent_only(self) -> CacheSnapshot:
        """The checkpoint part: recurrent states only (attention KV dropped)."""
        layers = tuple(LayerSnapshot(layer.kind, None, layer.recurrent) for layer in self.layers)
        return CacheSnapshot(self.length, layers, has_attention=False, has_recurrent=self.has_recurrent)

    def attention_only(self) -> CacheSnapshot:
        layers = tuple(LayerSnapshot(layer.kind, layer.attention, None) for layer in self.layers)
        return CacheSnapshot(self.length, layers, has_attention=self.has_attention, has_recurrent=False)

    def to(self, device: torch.device | str) -> CacheSnapshot:
        layers = tuple(
            LayerSnapshot(
                layer.kind,
                layer.attention.to(device) if layer.attention else None,
                layer.recurrent.to(device) if layer.recurrent else None,
            )
            for layer in self.layers
        )
        return CacheSnapshot(self.length, layers, self.has_attention, self.has_recurrent)


def snapshot_cache(
    cache: DynamicCache, length: int, kinds: list[LayerKind], *, attention: bool = True, clone: bool = True
) -> CacheSnapshot:
    """Clone the state of ``cache``, which has consumed exactly ``length`` tokens (``attention=False``: the
    recurrent parts only, without copying the attention KV — a sparse checkpoint). ``clone=False``: views of
    the live tensors, for a caller that copies what it keeps at once (the cache updates them in place)."""
    copy = (lambda t: t.clone()) if clone else (lambda t: t)
    if len(cache.layers) != len(kinds):
        raise KVStateError(
            f"cache has {len(cache.layers)} layers but the model config has {len(kinds)}; "
            "snapshot a cache built with DynamicCache(config=model.config)."
        )
    layers = []
    for i, (layer, kind) in enumerate(zip(cache.layers, kinds, strict=True)):
        att: AttentionState | None = None
        recurrent: RecurrentState | None = None
        if isinstance(layer, DummyLayer):  # a layer reading another's KV (cross-layer sharing): nothing to copy
            layers.append(LayerSnapshot(kind))
            continue
        if attention and kind in (LayerKind.ATTENTION, LayerKind.HYBRID):
            if not isinstance(layer, DynamicLayer) or layer.keys is None or not layer.is_initialized:
                raise KVStateError(f"layer {i} ({kind}) holds no attention KV yet; run a forward pass before snapshotting.")
            if layer.keys.shape[-2] != length:
                raise KVStateError(
                    f"layer {i} holds {layer.keys.shape[-2]} tokens of KV but the snapshot was asked at {length}; "
                    "snapshot exactly at the position the cache has reached (sliding-window layers are not supported)."
                )
            att = AttentionState(copy(layer.keys), copy(layer.values))
        if kind in (LayerKind.RECURRENT, LayerKind.HYBRID):
            if not isinstance(layer, LinearAttentionCacheLayerMixin) or not layer.is_recurrent_states_initialized[0]:
                raise KVStateError(f"layer {i} ({kind}) holds no recurrent state yet; run a forward pass first.")
            if layer.number_of_states != 1:
                raise KVStateError(f"layer {i} carries {layer.number_of_states} recurrent states; kvstate supports 1.")
            recurrent = RecurrentState(copy(layer.conv_states[0]), copy(layer.recurrent_states[0]))
        layers.append(LayerSnapshot(kind, att, recurrent))
    return CacheSnapshot(length, tuple(layers), has_attention=attention)


def restore_cache(
    config: Any,
    snapshot: CacheSnapshot,
    length: int | None = None,
    recurrent: CacheSnapshot | None = None,
    *,
    copy: bool = True,
) -> ResumableCache:
    """A fresh ``DynamicCache`` (a :class:`ResumableCache`) holding ``snapshot``'s state at ``length`` tokens.

    Attention KV comes from ``snapshot`` sliced to ``length`` (default: its full length). Recurrent
    state comes from ``recurrent`` when given (a checkpoint, which must be at ``length``), else from
    ``snapshot`` (then ``length`` must equal ``snapshot.length``: a recurrent state cannot be sliced).
    The cache reports ``length`` to ``model.generate``, which then feeds only the tokens after it.
    ``copy=False``: the snapshot's tensors are fresh and handed over (the cache may keep them as they are).
    """
    length = snapshot.length if length is None else length
    kinds = layer_kinds(config)
    source = recurrent if recurrent is not None else snapshot
    has_rec_layers = any(k in (LayerKind.RECURRENT, LayerKind.HYBRID) for k in kinds)
    has_attn_layers = any(k in (LayerKind.ATTENTION, LayerKind.HYBRID) for k in kinds)
    if not 0 < length <= snapshot.length and has_attn_layers:
        raise KVStateError(f"restore length {length} is outside 1..{snapshot.length} (the snapshot's length).")
    if has_attn_layers and not snapshot.has_attention:
        raise KVStateError("the snapshot holds no attention KV (recurrent-only checkpoint); pass the KV snapshot first.")
    if has_rec_layers and (source.length != length or not source.has_recurrent):
        raise KVStateError(
            f"no recurrent state at position {length}: the recurrent source is at {source.length}"
            f"{'' if source.has_recurrent else ' and holds no recurrent state'}; pass recurrent= a checkpoint taken at {length}."
        )
    if len(snapshot.layers) != len(kinds) or len(source.layers) != len(kinds):
        raise KVStateError(
            f"snapshot has {len(snapshot.layers)} layers but the config has {len(kinds)}: it was taken from another model."
        )
    kv: list[tuple[torch.Tensor, torch.Tensor] | None] = []
    states: list[tuple[torch.Tensor, torch.Tensor] | None] = []
    for i, kind in enumerate(kinds):
        att = snapshot.layers[i].attention if kind in (LayerKind.ATTENTION, LayerKind.HYBRID) else None
        if att is not None:
            part = att.sliced(length)
            # update() concatenates onto an empty cache, which copies: the snapshot stays unaliased
            kv.append((part.keys.clone(), part.values.clone()) if copy else (part.keys, part.values))
        else:
            kv.append(None)
        rec = source.layers[i].recurrent if kind in (LayerKind.RECURRENT, LayerKind.HYBRID) else None
        states.append(None if rec is None else (rec.conv.clone(), rec.recurrent.clone()) if copy
                      else (rec.conv, rec.recurrent))
    return fill_cache(config, kinds, kv, states, length)


def fill_cache(config: Any, kinds: list[LayerKind], kv: list[tuple[torch.Tensor, torch.Tensor] | None],
               states: list[tuple[torch.Tensor, torch.Tensor] | None], length: int) -> ResumableCache:
    """The one cache builder: a fresh :class:`ResumableCache` at ``length`` tokens, filled layer by layer.

    ``kv[i]``: layer ``i``'s keys and values ``(B, kv_heads, length, head_dim)`` (``None`` on an attention layer:
    a shared cross-layer layer, left a ``DummyLayer``); ``states[i]``: its ``(conv, recurrent)`` state. The
    tensors are handed over (the caller copies what it must keep); a recurrent / hybrid layer without a state
    is refused. Used by :func:`restore_cache` and the prefix store's path builder.
    """
    cache = ResumableCache(config)
    for i, (layer, kind) in enumerate(zip(cache.layers, kinds, strict=True)):
        if kind in (LayerKind.ATTENTION, LayerKind.HYBRID):
            if kv[i] is None and kind == LayerKind.ATTENTION:  # shared (cross-layer) layer: stays a DummyLayer
                cache.layers[i] = DummyLayer()
                continue
            pair = kv[i]
            if pair is None:
                raise KVStateError(f"layer {i} ({kind.value}) has no attention KV to fill the cache with.")
            layer.update(pair[0], pair[1])
        if kind in (LayerKind.RECURRENT, LayerKind.HYBRID):
            st = states[i]
            if st is None:
                raise KVStateError(f"no recurrent state at position {length} to restore.")
            layer.update_conv_state(st[0])  # type: ignore[union-attr]
            layer.update_recurrent_state(st[1])  # type: ignore[union-attr]
            set_recurrent_length(layer, length)
    return cache.seal(length)
