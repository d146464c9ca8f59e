"""Integer codes for the wire: symmetric per-channel int8 / int4 and KIVI-style asymmetric 4-bit KV.

Codes of *Semantic Cache Distillation: Efficient State Transfer via Reuse and Selective Patching* are
quantized per channel (a code channel's scale is its absolute maximum over the tokens), which suits
low-rank codes whose channels differ by their singular values. The 4-bit raw-KV baseline follows
*KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache*: keys per channel, values per token,
each with a min/max (scale + zero point). int4 values are packed two per byte. Ignored: KIVI's
full-precision residual window and grouping along tokens.
"""

from __future__ import annotations

import torch

BITS = (8, 4, 16, 32)  # 16 / 32: codes sent as fp16 / fp32, no scales


def _pack4(q: torch.Tensor) -> torch.Tensor:
    """(..., C) ints in [0, 15] -> (..., ceil(C/2)) uint8, low nibble first."""
    q = q.to(torch.uint8)
    if q.shape[-1] % 2:
        q = torch.nn.functional.pad(q, (0, 1))
    return q[..., 0::2] | (q[..., 1::2] << 4)


def _unpack4(p: torch.Tensor, channels: int) -> torch.Tensor:
    lo, hi = p & 0x0F, p >> 4
    return torch.stack([lo, hi], dim=-1).flatten(-2)[..., :channels]


def quantize_codes(z: torch.Tensor, bits: int) -> dict[str, torch.Tensor]:
    """Codes ``z`` (T, C) -> wire tensors: ``q`` (and ``scale`` (C,) fp32 for 8 / 4 bits)."""
    if bits not in BITS:
        raise ValueError(f"bits={bits} must be one of {BITS}")
    if bits == 32:
        return {"q": z.float().contiguous()}
    if bits == 16:
        return {"q": z.half().contiguous()}
    top = 127 if bits == 8 else 7
    scale = (z.abs().amax(dim=0) / top).clamp_min(1e-12).float()  # (C,)
    q = torch.round(z / scale).clamp(-top - 1, top)
    if bits == 8:
        return {"q": q.to(torch.int8).contiguous(), "scale": scale}
    return {"q": _pack4(q + 8).contiguous(), "scale": scale}


def dequantize_codes(t: dict[str, torch.Tensor], bits: int, channels: int) -> torch.Tensor:
    """Inverse of :func:`quantize_codes`: (T, channels) fp32."""
    q = t["q"]
    if bits in (16, 32):
        return q.float()
    if bits == 8:
        return q.float() * t["scale"]
    return (_unpack4(q, channels).float() - 8.0) * t["scale"]


def kivi_quantize(k: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
    """4-bit KV (T, C) each: keys per channel (stats over tokens), values per token (stats over channels)."""
    out: dict[str, torch.Tensor] = {}
    for name, x, dim in (("k", k.float(), 0), ("v", v.float(), 1)):
        lo, hi = x.amin(dim=dim, keepdim=True), x.amax(dim=dim, keepdim=True)
        scale = ((hi - lo) / 15).clamp_min(1e-12)
        q = torch.round((x - lo) / scale).clamp(0, 15)
        out[f"{name}.q"] = _pack4(q).contiguous()
        out[f"{name}.scale"], out[f"{name}.zero"] = scale.half().contiguous(), lo.half().contiguous()
    return out


def kivi_dequantize(t: dict[str, torch.Tensor], channels: int) -> tuple[torch.Tensor, torch.Tensor]:
    k, v = (_unpack4(t[f"{n}.q"], channels).float() * t[f"{n}.scale"].float() + t[f"{n}.zero"].float()
            for n in ("k", "v"))
    return k, v
