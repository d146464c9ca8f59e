"""Shared-KV attention for HF decoder models: the forward that both routing and sharing install.

Cross-layer KV sharing ("Reducing Transformer Key-Value Cache Size with Cross-Layer Attention") and
Random Cross-Layer Attention ("Stochastic KV Routing") need the same thing from a model: at each
forward pass, a *route* (a :class:`~kvstate.depth.patterns.SharingPattern`) says which layer's K/V
each attention layer reads. :func:`routed` installs, for the duration of a ``with`` block, an
attention forward that follows the route, in one of two modes:

- owners only (deployment, fixed patterns, the ``owner`` routing variant): an owner computes its K/V,
  writes them through ``cache.update`` when a cache is passed, and publishes what it attends to (the
  whole cached K/V) for the layers below it in the route; a non-owner computes only its queries (no
  K/V projections) and attends to its owner's published K/V;
- every layer's own K/V (``own_kv=True``, R-CLA training as the paper describes it): every attention
  layer computes (and caches) its own K/V and publishes it; a routed layer attends to its source's
  *own* K/V, so the source may itself be routed elsewhere (``0_0_1_2``).

Both behave the same *with or without a cache object*, so training (no cache) and inference (cache)
run the same computation under the same route.

A forward pre-hook on the decoder asks the router for the pass's route; the hooks and the forward
are removed on exit, also on exceptions. The attention kernel is HF's own (``ALL_ATTENTION_FUNCTIONS``,
so SDPA / eager follow the model's setting). Supported: attention modules of the Qwen3 and Llama
layouts. Ignored: Qwen3.5 gated attention and other layouts (they raise).
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from kvstate.depth.patterns import LayerSpec, SharingPattern
from kvstate.errors import UnsupportedModelError
from kvstate.models.compat import ALL_ATTENTION_FUNCTIONS, attn_implementation, family_function
from kvstate.models.families import LayerKind, layer_kinds, text_config
from kvstate.models.rotary import rotate, rotate_qk

# attention class -> whether it normalises q and k per head (Qwen3) before RoPE
SUPPORTED = {"Qwen3Attention": True, "LlamaAttention": False, "Qwen2Attention": False, "MistralAttention": False}


def layer_specs(config: Any) -> list[LayerSpec]:
    """The sharing rules' view of a model config: per layer its attention type and KV shape (or recurrent)."""
    tc = text_config(config)
    kinds = layer_kinds(config)
    types_ = getattr(tc, "layer_types", None) or ["full_attention"] * len(kinds)
    head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
    specs = []
    for kind, ltype in zip(kinds, types_, strict=True):
        if kind == LayerKind.ATTENTION:
            name = "sliding_attention" if ltype == "sliding_attention" else "full_attention"
            specs.append(LayerSpec(name, int(tc.num_key_value_heads), int(head_dim)))
        else:
            specs.append(LayerSpec("recurrent"))
    return specs


def attention_modules(model: Any) -> dict[int, torch.nn.Module]:
    """Layer index -> the attention module of each attention decoder layer; raises for unsupported layouts."""
    decoder = model.get_decoder()
    kinds = layer_kinds(model.config)
    found: dict[int, torch.nn.Module] = {}
    for i, layer in enumerate(decoder.layers):
        if kinds[i] != LayerKind.ATTENTION:
            continue
        attn = getattr(layer, "self_attn", None)
        if attn is None or type(attn).__name__ not in SUPPORTED:
            raise UnsupportedModelError(f"layer {i}: attention class {type(attn).__name__!r} is not supported by "
                                        f"kvstate.depth; supported: {', '.join(SUPPORTED)}")
        found[i] = attn
    return found


class Router:
    """Holds the route of the current forward pass and the K/V published in it (by owners, or with
    ``own_kv`` by every attention layer: its own K/V)."""

    def __init__(self, layers: list[LayerSpec], draw: Callable[[], SharingPattern], own_kv: bool = False) -> None:
        self.layers = layers
        self._draw = draw
        self.own_kv = own_kv  # every layer computes its own K/V; a route may read a non-owner's own K/V
        self.route: SharingPattern | None = None
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def begin(self) -> None:
        self.route = self._draw().validate(self.layers, require_owners=not self.own_kv)
        self.kv.clear()

    def end(self) -> None:
        self.kv.clear()  # the autograd graph keeps what backward needs; drop our references


def _routed_forward(self: Any, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                    attention_mask: torch.Tensor | None, cache: Any = None, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    router: Router = self._kvstate_router
    layer = self.layer_idx
    if router.route is None:
        raise RuntimeError("kvstate.depth: attention ran outside a routed decoder forward")
    src = router.route.sources[layer]
    qk_norm = SUPPORTED[type(self).__name__]
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    cos, sin = position_embeddings
    q = self.q_proj(hidden_states).view(hidden_shape)  # (B, T, H, D)
    if qk_norm:
        q = self.q_norm(q)
    q = q.transpose(1, 2)  # (B, H, T, D)
    if src == layer or router.own_kv:
        k = self.k_proj(hidden_states).view(hidden_shape)
        if qk_norm:
            k = self.k_norm(k)
        k = k.transpose(1, 2)  # (B, KVH, T, D)
        v = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)  # (B, KVH, T, D)
        q, k = rotate_qk(self, q, k, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v, layer, kwargs=kwargs)  # (B, KVH, past + T, D)
        router.kv[layer] = (k, v)  # this layer's own K/V (an owner's is also what it attends to)
        if src != layer:
            k, v = router.kv[src]  # own_kv: the source's own K/V (it ran earlier in this pass)
    else:
        q = rotate(self, q, cos, sin)  # RoPE on queries only
        k, v = router.kv[src]  # the owner ran earlier in this pass (patterns only point backwards)
    interface = ALL_ATTENTION_FUNCTIONS.get_interface(attn_implementation(self.config),
                                                  family_function(self, "eager_attention_forward"))
    out, weights = interface(self, q, k, v, attention_mask, dropout=0.0 if not self.training else self.attention_dropout,
                             scaling=self.scaling, sliding_window=getattr(self, "sliding_window", None), **kwargs)
    out = out.reshape(*input_shape, -1).contiguous()  # (B, T, H * D)
    return self.o_proj(out), weights


@contextmanager
def routed(model: Any, draw: Callable[[], SharingPattern], *, own_kv: bool = False) -> Iterator[Router]:
    """Install the routed attention on ``model`` until the block exits; ``draw()`` gives each pass's route.

    ``own_kv=False``: owners only compute K/V (a route must be a valid sharing pattern); ``own_kv=True``:
    every attention layer computes its own K/V and a routed layer reads its source's own K/V.
    """
    modules = attention_modules(model)
    router = Router(layer_specs(model.config), draw, own_kv)
    decoder = model.get_decoder()
    if getattr(decoder, "_kvstate_router", None) is not None:
        raise RuntimeError("kvstate.depth: the model is already routed; nest apply_sharing / routing blocks not")
    handles = [decoder.register_forward_pre_hook(lambda _m, _a: router.begin()),
               decoder.register_forward_hook(lambda _m, _a, _o: router.end())]
    decoder._kvstate_router = router
    try:
        for attn in modules.values():
            attn._kvstate_router = router
            attn.forward = types.MethodType(_routed_forward, attn)
        yield router
    finally:
        for h in handles:
            h.remove()
        for attn in modules.values():
            attn.__dict__.pop("forward", None)
            attn.__dict__.pop("_kvstate_router", None)
        decoder.__dict__.pop("_kvstate_router", None)
        router.end()


__all__ = ["SUPPORTED", "Router", "attention_modules", "layer_specs", "routed"]
