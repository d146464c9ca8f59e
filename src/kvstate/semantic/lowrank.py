"""Low-rank SVD codec of a span's token-level K/V, with a rank set by soft singular-value gates.

From "SEKV: Resolution-Adaptive Semantic KV Cache with Hierarchical Semantic Memory": the slow tier
keeps each span's keys and values as a low-rank SVD basis; a light predictor gives every singular value
a soft gate from the span's spectrum, and the span's rank is the number of gates above one half (at
least 1). ``A = U_r diag(S_r)`` (n, r) and ``B = V_r^T`` (r, D) are stored; ``A @ B`` reconstructs the
tokens. At full rank ``r = min(n, D)`` the reconstruction is exact up to float rounding (the SVD runs in
float64). A predicted rank is capped so the factors never take more bytes than the raw tokens
(``n r + r D <= n D``); a fixed rank is used as given (full rank is the oracle in the tests). The cache
allocates the predicted ranks of many spans under a slow-tier byte budget (:mod:`kvstate.semantic.ranks`)
from :func:`svd` and :func:`truncate`; :class:`Raw` keeps a span's K/V as they are (the raw-offload
ablation). Ignored: a memory-mapped slow tier (tensors stay in CPU memory).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

N_FEATURES = 5


@dataclass
class LowRank:
    """One span's K or V at rank ``r`` for every KV head: ``a @ b`` reconstructs (H, n, D)."""

    a: torch.Tensor  # (H, n, r) left factor scaled by singular values
    b: torch.Tensor  # (H, r, D) right factor

    @property
    def rank(self) -> int:
        return int(self.a.shape[-1])

    @property
    def nbytes(self) -> int:
        return self.a.nbytes + self.b.nbytes

    def reconstruct(self, dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> torch.Tensor:
        out = self.a.to(device=device) @ self.b.to(device=device)  # (H, n, D)
        return out.to(dtype) if dtype is not None else out


@dataclass
class Raw:
    """One span's K or V kept as is (H, n, D): the raw-offload ablation (rank = full, exact)."""

    x: torch.Tensor  # (H, n, D)

    @property
    def rank(self) -> int:
        return int(min(self.x.shape[1], self.x.shape[2]))

    @property
    def nbytes(self) -> int:
        return self.x.nbytes

    def reconstruct(self, dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> torch.Tensor:
        return self.x.to(device=device, dtype=dtype if dtype is not None else self.x.dtype)


def spectrum_features(s: torch.Tensor, is_value: bool) -> torch.Tensor:
    """Gate-predictor features per singular value: (..., k) spectrum → (..., k, N_FEATURES)."""
    k = s.shape[-1]
    top = s[..., :1].clamp_min(1e-12)
    rel = s / top
    energy = (s**2).cumsum(-1) / (s**2).sum(-1, keepdim=True).clamp_min(1e-24)
    idx = torch.arange(k, dtype=s.dtype, device=s.device).expand_as(s) / max(k, 1)
    flag = torch.full_like(s, 1.0 if is_value else 0.0)
    return torch.stack([rel, torch.log(rel + 1e-6) / 10, idx, energy, flag], dim=-1)


class RankGate(nn.Module):
    """Soft gate per singular value from the span's normalised spectrum (a 2-layer MLP, shared)."""

    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(N_FEATURES, hidden), nn.Tanh(), nn.Linear(hidden, 1))
        with torch.no_grad():  # untrained: keep singular values carrying the first ~95% of the energy
            self.net[0].weight.zero_()
            self.net[0].bias.zero_()
            self.net[0].weight[0, 3] = -4.0  # hidden unit 0 falls as cumulative energy rises
            self.net[0].bias[0] = 3.8
            self.net[2].weight.zero_()
            self.net[2].weight[0, 0] = 6.0
            self.net[2].bias.fill_(-0.5)

    def forward(self, s: torch.Tensor, is_value: bool) -> torch.Tensor:
        """Gates in (0, 1) of shape ``s.shape`` for spectra ``s`` (..., k), descending."""
        return torch.sigmoid(self.net(spectrum_features(s.float(), is_value)).squeeze(-1))


def svd(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Thin SVD in float64 of (..., n, D): U (..., n, k), S (..., k), Vh (..., k, D), k = min(n, D)."""
    u, s, vh = torch.linalg.svd(x.double(), full_matrices=False)
    return u, s, vh


def rank_from_gates(gates: torch.Tensor) -> int:
    """Span rank: gates (H, k) averaged over heads, count above one half, at least 1."""
    return max(1, int((gates.mean(0) > 0.5).sum()))


def byte_cap(n: int, d: int) -> int:
    """The largest rank whose factors take no more bytes than the raw tokens: ``n r + r D <= n D``."""
    return max(1, (n * d) // (n + d))


def gate_rank(s: torch.Tensor, gate: RankGate, is_value: bool) -> int:
    """The predictor's rank of one span from its spectra (H, k), within the byte cap."""
    with torch.no_grad():
        return rank_from_gates(gate(s, is_value))


def truncate(u: torch.Tensor, s: torch.Tensor, vh: torch.Tensor, rank: int, store_dtype: torch.dtype) -> LowRank:
    """Keep the first ``rank`` singular triplets of an SVD (:func:`svd`) as factors."""
    r = min(rank, s.shape[-1])
    a = (u[..., :r] * s[..., None, :r]).to(store_dtype).contiguous()  # (H, n, r)
    b = vh[..., :r, :].to(store_dtype).contiguous()  # (H, r, D)
    return LowRank(a, b)


def encode(x: torch.Tensor, rank: int | None, gate: RankGate | None, is_value: bool,
           store_dtype: torch.dtype = torch.float32) -> LowRank:
    """Encode one span (H, n, D) at a fixed ``rank`` (clipped to min(n, D)), or the gates' rank if None."""
    if x.dim() != 3:
        raise ValueError(f"encode: x must be (heads, tokens, head_dim), got shape {tuple(x.shape)}")
    u, s, vh = svd(x)
    k = s.shape[-1]
    if rank is None:
        if gate is None:
            raise ValueError("encode: pass a fixed rank or a RankGate")
        r = min(gate_rank(s, gate, is_value), byte_cap(x.shape[1], x.shape[2]))
    else:
        if rank < 1:
            raise ValueError(f"encode: rank={rank} must be >= 1")
        r = min(rank, k)
    return truncate(u, s, vh, r, store_dtype)


def gated_reconstruction(x: torch.Tensor, gate: RankGate, is_value: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable (in the gate) reconstruction ``U diag(g * S) Vh`` and the gates, for training."""
    u, s, vh = svd(x.detach())
    g = gate(s, is_value)  # (..., k)
    rec = (u.float() * (g * s.float())[..., None, :]) @ vh.float()
    return rec, g
