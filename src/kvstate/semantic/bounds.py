"""Per-span key bounds and Quest's upper bound on ``q . k``: the routing signal of the span store.

From "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference": a block of keys is summarised
by the element-wise minimum and maximum of its keys per channel, and for a query ``q`` the bound
``sum_c max(q_c lo_c, q_c hi_c)`` is at least ``q . k`` for every key ``k`` of the block (each term is
the largest ``q_c k_c`` can be with ``lo_c <= k_c <= hi_c``). A block that holds a key aligned with the
query can therefore never be ranked below its own best logit — the guarantee learned or low-rank scores
lack (Loki's approximate keys, SEKV's learned relevance). The span store ranks spans by this bound
over the keys it will actually read: the dequantized keys of a quantized span (whose quantizer range
*is* the bound, :mod:`kvstate.semantic.quant`), the reconstructed keys of a low-rank one
(``docs/techniques.md#resolution``).

A low-rank span's keys are ``a @ b`` (``a`` (n, r) coordinates, ``b`` (r, D) basis, :mod:`kvstate.semantic.lowrank`),
so ``q . k_i = (b q) . a_i``: the same bound taken in the rank-r coordinates — the per-coordinate min / max
of ``a`` against the projected query ``b q`` — is at least every logit of the reconstructed keys too
(:func:`rank_bounds`, :func:`rank_upper_bound`). It needs the basis at routing time: ``r D + 2 r`` numbers
per span and head against ``2 D`` for the box in key coordinates, fewer only at rank 1. Ignored: Quest's
per-page kernels (one batched matmul here).
"""

from __future__ import annotations

import torch


def key_bounds(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel minimum and maximum of a span's keys: (H, n, D) → lo (H, D), hi (H, D)."""
    return keys.amin(1), keys.amax(1)


def upper_bound(query: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Quest's bound of every query row against every span: query (H, M, D), lo / hi (H, S, D) → (H, M, S).

    ``max(q lo, q hi)`` is ``q hi`` where ``q >= 0`` and ``q lo`` elsewhere (``lo <= hi``), so the bound is
    two matmuls rather than an (H, M, S, D) intermediate.
    """
    q = query.float()
    pos, neg = q.clamp_min(0), q.clamp_max(0)  # (H, M, D)
    return pos @ hi.float().transpose(-1, -2) + neg @ lo.float().transpose(-1, -2)  # (H, M, S)


def rank_bounds(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-coordinate minimum and maximum of a low-rank span's coordinates: a (H, n, r) → lo (H, r), hi (H, r)."""
    return a.amin(1), a.amax(1)


def rank_upper_bound(query: torch.Tensor, b: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """The bound in rank-r coordinates of every query row against one low-rank span: query (H, M, D), basis
    b (H, r, D), lo / hi (H, r) → (H, M), at least ``q . (a @ b)_i`` for every row i of ``a`` within lo / hi."""
    p = query.float() @ b.float().transpose(-1, -2)  # (H, M, r) the query in the span's coordinates
    return (p.clamp_min(0) * hi.float()[:, None] + p.clamp_max(0) * lo.float()[:, None]).sum(-1)

