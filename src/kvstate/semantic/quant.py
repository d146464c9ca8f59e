"""A KIVI-style quantized slow tier: keys per channel, values per token, outlier spans kept exact.

From "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache": keys have a few channels of large
magnitude, so they are quantized per channel (one range per channel, grouped over the tokens of a
span); values are quantized per token (one range per token over its channels). Both are asymmetric:
``code = round((x - lo) / step)``, ``step = (hi - lo) / (2^bits - 1)``, and ``lo + code * step``
dequantizes, clamped to ``[lo, hi]`` so rounding never steps outside the range. A key span's
per-channel range is the span's per-channel min / max — Quest's routing bound
(:mod:`kvstate.semantic.bounds`) — so the store keeps it once, in the fast tier, and the slow tier holds
only the packed codes: the index costs no extra bytes and bounds exactly the dequantized keys attention
reads. Codes are packed ``8 // bits`` to a byte along the channels.

From "ShadowKV: KV Cache in Shadows for High-Throughput Long-Context LLM Inference": spans whose keys
are not alike (low mean cosine similarity of each key to the span's mean key) are the ones a shared
range serves worst; :func:`outlier_spans` names the least similar share of them, which the store keeps
unquantized. ``bits=16`` keeps a span unquantized at the cache's own precision (16 bits on the
half-precision models this targets; bytes are counted from the tensors, so an fp32 cache counts 32).
Ignored: KIVI's full-precision residual of recent tokens (the store's recent window plays that part)
and fused dequantization kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BITS = (2, 4, 8, 16)
EXACT = 16  # "16 bits": not quantized, kept at the cache's precision


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes in ``[0, 2^bits)`` (..., D) uint8 → (..., ceil(D * bits / 8)) uint8, ``8 // bits`` per byte."""
    per = 8 // bits
    d = codes.shape[-1]
    pad = (-d) % per
    if pad:
        codes = torch.cat([codes, codes.new_zeros(*codes.shape[:-1], pad)], -1)
    grouped = codes.reshape(*codes.shape[:-1], -1, per).to(torch.int32)  # (..., D/per, per)
    shifts = torch.arange(per, dtype=torch.int32) * bits
    return (grouped << shifts).sum(-1).to(torch.uint8)


def unpack(packed: torch.Tensor, bits: int, d: int) -> torch.Tensor:
    """Inverse of :func:`pack`: (..., ceil(D * bits / 8)) uint8 → codes (..., D) uint8."""
    per = 8 // bits
    shifts = torch.arange(per, dtype=torch.int32) * bits
    codes = (packed.to(torch.int32)[..., None] >> shifts) & ((1 << bits) - 1)  # (..., D/per, per)
    return codes.reshape(*packed.shape[:-1], -1)[..., :d].to(torch.uint8)


def _codes(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, bits: int) -> torch.Tensor:
    levels = (1 << bits) - 1
    step = ((hi - lo).float() / levels).clamp_min(torch.finfo(torch.float32).tiny)
    return ((x.float() - lo.float()) / step).round().clamp(0, levels).to(torch.uint8)


def _dequantize(codes: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, bits: int) -> torch.Tensor:
    step = (hi.float() - lo.float()) / ((1 << bits) - 1)
    # clamped: lo + levels * step can round one ulp past hi, and hi is the routing bound
    return torch.minimum(torch.maximum(lo.float() + codes.float() * step, lo.float()), hi.float())


@dataclass
class QuantKeys:
    """One span's keys quantized per channel; the range (lo, hi) is held by the store as the span's bounds."""

    codes: torch.Tensor  # (H, n, ceil(D * bits / 8)) uint8 packed codes
    bits: int
    head_dim: int

    @property
    def rank(self) -> int:  # the slow-tier histograms count resolution per entry; a quantized entry is full rank
        return self.head_dim

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes

    def dequantize(self, lo: torch.Tensor, hi: torch.Tensor, dtype: torch.dtype,
                   device: torch.device | str | None = None) -> torch.Tensor:
        """Keys (H, n, D) from the codes and the per-channel range lo / hi (H, D)."""
        codes = unpack(self.codes.to(device=device), self.bits, self.head_dim)  # (H, n, D)
        lo, hi = lo.to(device=device)[:, None], hi.to(device=device)[:, None]  # (H, 1, D)
        return _dequantize(codes, lo, hi, self.bits).to(dtype)


@dataclass
class QuantValues:
    """One span's values quantized per token: codes and each token's range (lo, hi)."""

    codes: torch.Tensor  # (H, n, ceil(D * bits / 8)) uint8 packed codes
    lo: torch.Tensor  # (H, n, 1) per-token minimum, in the cache's dtype
    hi: torch.Tensor  # (H, n, 1) per-token maximum
    bits: int
    head_dim: int

    @property
    def rank(self) -> int:
        return self.head_dim

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.lo.nbytes + self.hi.nbytes

    def reconstruct(self, dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> torch.Tensor:
        codes = unpack(self.codes.to(device=device), self.bits, self.head_dim)  # (H, n, D)
        out = _dequantize(codes, self.lo.to(device=device), self.hi.to(device=device), self.bits)
        return out.to(dtype if dtype is not None else self.lo.dtype)


def quantize_keys(keys: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, bits: int) -> QuantKeys:
    """Keys (H, n, D) per channel within lo / hi (H, D) — the span's bounds, which must contain them."""
    return QuantKeys(pack(_codes(keys, lo[:, None], hi[:, None], bits), bits).contiguous(), bits, keys.shape[-1])


def quantize_values(values: torch.Tensor, bits: int) -> QuantValues:
    """Values (H, n, D) per token (the range of each token over its channels)."""
    lo, hi = values.amin(-1, keepdim=True), values.amax(-1, keepdim=True)  # (H, n, 1)
    codes = pack(_codes(values, lo, hi, bits), bits).contiguous()
    return QuantValues(codes, lo.contiguous(), hi.contiguous(), bits, values.shape[-1])


def quant_nbytes(n: int, d: int, heads: int, bits: int, element_size: int) -> int:
    """Slow-tier bytes of one span quantized at ``bits`` (keys: codes; values: codes + per-token range);
    ``bits=16``: the raw K/V at the cache's precision."""
    if bits == EXACT:
        return 2 * heads * n * d * element_size
    row = -(-d * bits // 8)
    return heads * n * (2 * row + 2 * element_size)


def in_span_similarity(keys: torch.Tensor) -> float:
    """ShadowKV's outlier criterion: mean over heads and tokens of cos(key, span's mean key); keys (H, n, D)."""
    k = keys.float()
    return float(torch.nn.functional.cosine_similarity(k, k.mean(1, keepdim=True), dim=-1).mean())


def outlier_spans(similarity: list[float], share: float) -> set[int]:
    """The ``floor(share * S)`` spans of lowest in-span similarity (ties to the earlier span)."""
    k = int(share * len(similarity))
    order = sorted(range(len(similarity)), key=lambda i: (similarity[i], i))
    return set(order[:k])
