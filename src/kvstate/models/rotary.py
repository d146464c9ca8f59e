"""Rotary position embeddings of HF decoder models, read in one place (RoFormer's RoPE as transformers writes it).

Two axes need a model's own rotary embedding outside its attention forward: cross-layer KV sharing
(``kvstate.depth``: a layer that reads another layer's K/V rotates only its queries) and cross-model
state transfer (``kvstate.transfer``: keys travel before rotary and the consumer rotates them at their
positions). Both use the family's own functions from its modeling module (``apply_rotary_pos_emb``,
``rotate_half``), so a family's convention (half-split pairs, partial rotary) is the one its forward
uses. Ignored: interleaved-pair (GPT-J style) families, which no supported model uses.
"""

from __future__ import annotations

from typing import Any

import torch

from kvstate.models.compat import family_function, family_module


def rotary_tables(model: Any, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each (1, T, head_dim), of ``model``'s rotary embedding at ``positions`` (T,)."""
    probe = torch.zeros(1, 1, dtype=next(model.parameters()).dtype)
    cos, sin = model.model.rotary_emb(probe, positions[None])
    return torch.as_tensor(cos), torch.as_tensor(sin)


def rotate(owner: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_axis: int = 1) -> torch.Tensor:
    """``x`` rotated by ``cos`` / ``sin`` with the family's ``rotate_half``; the tables gain a head axis at
    ``head_axis`` ((B, H, T, D) with (B, T, D) tables, or (T, H, D) with (T, D) tables: ``head_axis=1``)."""
    return x * cos.unsqueeze(head_axis) + family_function(owner, "rotate_half")(x) * sin.unsqueeze(head_axis)


def rotate_qk(attn: Any, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries and keys (B, H, T, D) rotated as ``attn``'s own forward does (its family's
    ``apply_rotary_pos_emb``)."""
    q2, k2 = family_function(attn, "apply_rotary_pos_emb")(q, k, cos, sin)
    return q2, k2


__all__ = ["family_module", "rotary_tables", "rotate", "rotate_qk"]
