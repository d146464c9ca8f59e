"""Seeding a new reference model from a trained one (``kvstate train --init-from``).

The hybrid reference model (Qwen3.5 text: Gated DeltaNet + gated attention) starts from the attention
model's weights: tensors whose names (layer index rescaled) and shapes match are copied, with the two
translations Qwen3.5 needs (gated ``q_proj`` holds [query | gate] per head; its RMSNorms scale by 1 + w),
and the Gated DeltaNet output projections start at zero so the new branches add nothing until trained.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kvstate.errors import ModelLoadError


def init_from_model(model: Any, source_dir: Path) -> int:
    """Copy every tensor of ``source_dir``'s model whose name (layer index rescaled) and shape match.

    Gated attention's query half of ``q_proj`` takes the source query; the recurrent layers' output
    projections start at zero so they add nothing until trained. Returns the number of tensors copied.
    """
    from kvstate.models.loading import load_model

    source = load_model(source_dir)  # checked: a missing or corrupt --init-from fails here, before training
    src = source.state_dict()
    # the gate / norm translations apply only from plain attention into Qwen3.5; same-family copies are verbatim
    gated = source.config.model_type != model.config.model_type and model.config.model_type.startswith("qwen3_5")
    layers = [int(k.split(".")[2]) for k in src if k.startswith("model.layers.")]
    if not layers:
        raise ModelLoadError(f"--init-from {str(source_dir)!r} has no model.layers.* tensors to copy; pass a "
                             "reference model trained by kvstate train (Qwen3 or Qwen3.5)")
    n_src = 1 + max(layers)
    n_dst = model.config.num_hidden_layers
    copied = 0
    zero_centered = {n for n, m in model.named_modules() if gated and type(m).__name__ == "Qwen3_5RMSNorm"}
    with torch.no_grad():
        for name, param in model.state_dict().items():
            key = name
            if name.startswith("model.layers."):
                parts = name.split(".")
                parts[2] = str(int(parts[2]) * n_src // n_dst)
                key = ".".join(parts)
            if gated and key.endswith("self_attn.q_proj.weight") and key in src and param.shape[0] == 2 * src[key].shape[0]:
                # Qwen3.5 gated attention: per head [query | gate]; copy the query, gate 0 (sigmoid 1/2)
                hd = model.config.head_dim
                view = param.view(-1, 2 * hd, param.shape[1])  # (H, 2*hd, hidden)
                view[:, :hd] = src[key].view(-1, hd, param.shape[1])
                view[:, hd:] = 0.0
                copied += 1
            elif gated and key.endswith("self_attn.o_proj.weight") and key in src and src[key].shape == param.shape:
                param.copy_(2.0 * src[key])  # undo the gate's 1/2
                copied += 1
            elif key in src and src[key].shape == param.shape:
                value = src[key].to(param.dtype)
                if name.removesuffix(".weight") in zero_centered:  # Qwen3.5 norms scale by (1 + w)
                    value = value - 1.0
                param.copy_(value)
                copied += 1
            elif name.endswith("linear_attn.out_proj.weight"):
                param.zero_()  # new Gated DeltaNet branches start silent: the copied residual stream is kept
    return copied


__all__ = ["init_from_model"]
