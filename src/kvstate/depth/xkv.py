"""Cross-layer low-rank KV compression, training-free: one shared SVD basis per group of adjacent layers.

The technique is xKV ("xKV: Cross-Layer SVD for KV-Cache Compression", Chang et al. 2025, arXiv 2503.18893):
adjacent layers' K (and V) caches share a dominant subspace, so the tokens x (layers x channels) matrix of a group
of ``group`` adjacent layers is factored by one truncated SVD, ``X ~ A @ B`` with ``A`` (tokens x r, the shared
token coefficients) and ``B`` (r x group*channels, each layer's slice of the basis), and only ``A`` and ``B`` are
held. It is the depth axis's training-free rival of cross-layer KV *sharing* at equal bytes: keep 0.5 (half the
layers own K/V) against a group's rank chosen so that ``A`` and ``B`` take half the bytes of the group's cache.

Here the factorisation is applied once, after the prefill, to the cache as stored (K after RoPE), and the cache
is replaced by its reconstruction ``A @ B`` (what attention would read from the factors); decoded tokens are
appended uncompressed, as xKV does for its recent window. :func:`rank_for` sizes the rank from a byte budget;
:func:`compress_cache` returns what the factors hold in bytes at a given element size (bf16: 2), so the
equal-byte comparison counts the basis too. Ignored: xKV's per-head grouping and its decode-time fused kernel
(reads are reconstructed here, not computed from the factors), and a per-layer choice of which layers to group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvstate.errors import KVStateError


@dataclass(frozen=True)
class XKVConfig:
    group: int = 4  # adjacent layers per shared basis
    ratio: float = 0.5  # bytes of the factors (A and B) over the group's full cache, at the same element size

    def __post_init__(self) -> None:
        if self.group < 1 or not 0 < self.ratio < 1:
            raise KVStateError(f"xKV group {self.group} / ratio {self.ratio}: need group >= 1 and 0 < ratio < 1")


def rank_for(tokens: int, width: int, ratio: float) -> int:
    """The largest rank r with ``tokens * r + r * width <= ratio * tokens * width`` (at least 1)."""
    return max(1, int(ratio * tokens * width // (tokens + width)))


@dataclass(frozen=True)
class Compressed:
    bytes_held: int  # A and B of every group, K and V, at the element size asked for
    bytes_full: int  # the full cache at the same element size
    ranks: tuple[int, ...]  # per group (K and V share it)

    @property
    def ratio(self) -> float:
        return self.bytes_held / self.bytes_full


@torch.no_grad()
def factor(x: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncated SVD of ``x`` (tokens x width): ``A`` (tokens x rank) and ``B`` (rank x width), ``A @ B ~ x``."""
    u, s, vh = torch.linalg.svd(x.double(), full_matrices=False)
    r = min(rank, s.numel())
    return (u[:, :r] * s[:r]).to(x.dtype), vh[:r].to(x.dtype)


@torch.no_grad()
def compress_cache(cache: Any, cfg: XKVConfig, element_bytes: int = 2) -> Compressed:
    """Replace, in place, every layer's K and V of a batch-1 ``DynamicCache`` by its group's rank-r reconstruction;
    returns the bytes the factors hold against the full cache (both at ``element_bytes`` per value)."""
    layers = list(cache.layers)
    if not layers or layers[0].keys is None:
        raise KVStateError("xKV: the cache is empty; prefill before compressing")
    b, h, t, d = layers[0].keys.shape
    if b != 1:
        raise KVStateError(f"xKV: batch {b}; compress one sequence's cache at a time")
    held = full = 0
    ranks = []
    for start in range(0, len(layers), cfg.group):
        grp = layers[start:start + cfg.group]
        width = len(grp) * h * d
        r = rank_for(t, width, cfg.ratio)
        ranks.append(r)
        for kind in ("keys", "values"):
            x = torch.cat([getattr(layer, kind)[0].transpose(0, 1).reshape(t, h * d) for layer in grp], dim=1)
            a, basis = factor(x, r)
            rec = a @ basis
            for j, layer in enumerate(grp):
                part = rec[:, j * h * d:(j + 1) * h * d].reshape(t, h, d).transpose(0, 1)[None]
                setattr(layer, kind, part.to(getattr(layer, kind).dtype).contiguous())
            held += (a.numel() + basis.numel()) * element_bytes
            full += x.numel() * element_bytes
    return Compressed(held, full, tuple(ranks))


__all__ = ["Compressed", "XKVConfig", "compress_cache", "factor", "rank_for"]
