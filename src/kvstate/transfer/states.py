"""Torch glue for cross-model state transfer: per-layer pre-attention inputs, keys and values, rotary
positions, and a transformers ``DynamicCache`` assembled from them.

Used by every method of *Semantic Cache Distillation: Efficient State Transfer via Reuse and Selective
Patching* and its baselines. Keys are handled *before* rotary embedding (after ``k_norm`` where the
family has one): a map between two models' keys must not depend on the token's position, and the
consumer applies its own rotary positions when it rebuilds the cache. Supports decoder-only
attention models whose layers run ``input_layernorm -> self_attn(k_proj, v_proj[, k_norm])`` with
standard rotary embeddings (Qwen3, Llama, Mistral, Qwen2). Ignored: hybrids and SSMs (their recurrent
state has no per-token K/V), sliding windows, batch > 1.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from kvstate.errors import UnsupportedModelError
from kvstate.models.families import LayerKind, layer_kinds
from kvstate.models.rotary import rotary_tables, rotate
from kvstate.models.state import fill_cache

K_NORM = {"qwen3": True, "llama": False, "mistral": False, "qwen2": False}  # family -> has per-head k_norm


@dataclass(frozen=True)
class Geometry:
    """The shape of a model's attention state: what a codec and a payload must agree on."""

    model_type: str
    n_layers: int
    n_kv_heads: int
    head_dim: int
    hidden_size: int

    def as_json(self) -> dict[str, Any]:
        return {"model_type": self.model_type, "n_layers": self.n_layers, "n_kv_heads": self.n_kv_heads,
                "head_dim": self.head_dim, "hidden_size": self.hidden_size}


def geometry(model: Any) -> Geometry:
    cfg = model.config
    if cfg.model_type not in K_NORM or any(k != LayerKind.ATTENTION for k in layer_kinds(cfg)):
        raise UnsupportedModelError(f"state transfer needs an attention-only model of {sorted(K_NORM)}; "
                                    f"got model_type {cfg.model_type!r}")
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", False):
        raise UnsupportedModelError("state transfer does not support sliding-window attention; disable it")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return Geometry(cfg.model_type, cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim, cfg.hidden_size)


def _layers(model: Any) -> Any:
    return model.model.layers


@contextmanager
def capture_inputs(model: Any, which: str = "attn") -> Iterator[dict[int, torch.Tensor]]:
    """Record each layer's input during forwards inside the ``with``: ``"attn"`` = the normalised
    pre-attention input H_in, ``"layer"`` = the residual stream entering the decoder layer. Hooks are
    always removed."""
    got: dict[int, torch.Tensor] = {}
    handles = []

    def hook(i: int) -> Any:
        def fn(_mod: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            got[i] = (args[0] if args else kwargs["hidden_states"]).detach()
        return fn

    try:
        for i, layer in enumerate(_layers(model)):
            mod = layer.self_attn if which == "attn" else layer
            handles.append(mod.register_forward_pre_hook(hook(i), with_kwargs=True))
        yield got
    finally:
        for h in handles:
            h.remove()


def project_kv(model: Any, layer: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys before rotary and values (T, H_kv, D) from a pre-attention input ``h`` (T, hidden), with
    ``model``'s own projections (and ``k_norm``)."""
    g = geometry(model)
    attn = _layers(model)[layer].self_attn
    h = h.to(attn.k_proj.weight.dtype)
    k = attn.k_proj(h).view(h.shape[0], g.n_kv_heads, g.head_dim)  # (T, H, D)
    if K_NORM[g.model_type]:
        k = attn.k_norm(k)
    v = attn.v_proj(h).view(h.shape[0], g.n_kv_heads, g.head_dim)
    return k, v


@dataclass
class LayerStates:
    """One prefill's per-layer states, batch dimension dropped."""

    h: list[torch.Tensor]  # per layer (T, hidden): normalised pre-attention input H_in
    k: list[torch.Tensor]  # per layer (T, H_kv, D): keys before rotary
    v: list[torch.Tensor]  # per layer (T, H_kv, D)
    logits: torch.Tensor  # (T, V)


@torch.inference_mode()
def prefill_states(model: Any, input_ids: torch.Tensor) -> LayerStates:
    """Run ``model`` on ``input_ids`` (1, T) and return every layer's H_in, K (pre-rotary) and V."""
    geometry(model)
    t = input_ids.shape[1]
    with capture_inputs(model, "attn") as got:
        out = model(input_ids=input_ids, position_ids=torch.arange(t)[None], use_cache=False)
    hs = [got[i][0] for i in range(len(got))]
    kv = [project_kv(model, i, h) for i, h in enumerate(hs)]
    return LayerStates(hs, [k for k, _ in kv], [v for _, v in kv], out.logits[0].float())


def build_cache(model: Any, keys: list[torch.Tensor], values: list[torch.Tensor], start: int = 0) -> DynamicCache:
    """A ``DynamicCache`` for ``model`` from per-layer pre-rotary keys and values (T, H_kv, D) at positions
    ``start .. start+T-1``: rotary applied with the model's own embedding, cast to its dtype, and filled by the
    one cache builder (:func:`kvstate.models.state.fill_cache`)."""
    dtype = next(model.parameters()).dtype
    t = keys[0].shape[0]
    cos, sin = rotary_tables(model, torch.arange(start, start + t))
    kv: list[tuple[torch.Tensor, torch.Tensor] | None] = []
    for k, v in zip(keys, values, strict=True):
        kr = rotate(model, k.to(dtype), cos[0], sin[0])  # (T, H_kv, D) with (T, D) tables
        kv.append((kr.transpose(0, 1)[None].contiguous(), v.to(dtype).transpose(0, 1)[None].contiguous()))
    return fill_cache(model.config, layer_kinds(model.config), kv, [None] * len(kv), t)


@torch.inference_mode()
def continue_logits(model: Any, cache: Any, input_ids: torch.Tensor, start: int) -> torch.Tensor:
    """Logits (T - start, V) of ``input_ids[:, start:]`` run on top of a cache holding ``start`` tokens."""
    t = input_ids.shape[1]
    out = model(input_ids=input_ids[:, start:], position_ids=torch.arange(start, t)[None], cache=cache,
                use_cache=True)
    return torch.as_tensor(out.logits[0]).float()
