"""Integer codes for the wire: symmetric per-channel int8 / int4 codes and KIVI's asymmetric 2 / 4-bit KV.

Codes of *Semantic Cache Distillation: Efficient State Transfer via Reuse and Selective Patching* are
quantized per channel (a code channel's scale is its absolute maximum over the tokens), which suits
low-rank codes whose channels differ by their singular values. The 4-bit raw-KV baseline follows
*KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache*: keys per channel (grouped over 32
tokens), values per token (grouped over 32 channels), each group with a min / max (scale + zero point),
and the most recent tokens (at least 128, the paper's residual length) in fp16. 4-bit values are packed
two per byte, 2-bit four per byte. Ignored: KIVI's streaming (the residual is re-quantized as decoding
appends tokens; a transferred prefix is quantized once).
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


KIVI_GROUP, KIVI_RESIDUAL = 32, 128  # the KIVI paper's group size G and full-precision residual length R


def _pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """(..., C) ints in [0, 2**bits) -> uint8, ``8 // bits`` per byte, lowest bits first."""
    if bits == 4:
        return _pack4(q)
    q = q.to(torch.uint8)
    pad = (-q.shape[-1]) % 4
    if pad:
        q = torch.nn.functional.pad(q, (0, pad))
    return q[..., 0::4] | (q[..., 1::4] << 2) | (q[..., 2::4] << 4) | (q[..., 3::4] << 6)


def _unpack(p: torch.Tensor, channels: int, bits: int) -> torch.Tensor:
    if bits == 4:
        return _unpack4(p, channels)
    return torch.stack([(p >> s) & 0x03 for s in (0, 2, 4, 6)], dim=-1).flatten(-2)[..., :channels]


def kivi_split(n_tokens: int, group: int = KIVI_GROUP, residual: int = KIVI_RESIDUAL) -> int:
    """Tokens quantized by KIVI: whole key groups of ``group`` tokens before the last ``residual`` (the
    remainder, at least ``residual`` recent tokens, stays in full precision)."""
    return max(0, n_tokens - residual) // group * group


def _minmax(x: torch.Tensor, dim: int, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    lo, hi = x.amin(dim=dim, keepdim=True), x.amax(dim=dim, keepdim=True)
    scale = ((hi - lo) / (2**bits - 1)).clamp_min(1e-12)
    return torch.round((x - lo) / scale).clamp(0, 2**bits - 1), scale, lo


def kivi_quantize(k: torch.Tensor, v: torch.Tensor, bits: int = 4, group: int = KIVI_GROUP,
                  residual: int = KIVI_RESIDUAL) -> dict[str, torch.Tensor]:
    """KIVI KV (T, C) each: keys per channel over groups of ``group`` tokens, values per token over groups of
    ``group`` channels, both asymmetric min / max at ``bits`` (2 or 4); the last tokens (:func:`kivi_split`) in fp16."""
    if bits not in (2, 4):
        raise ValueError(f"kivi bits={bits} must be 2 or 4")
    t, c = k.shape
    if c % group:
        raise ValueError(f"kivi: {c} channels are not a multiple of the group size {group}")
    n = kivi_split(t, group, residual)
    out: dict[str, torch.Tensor] = {"k.res": k[n:].half().contiguous(), "v.res": v[n:].half().contiguous()}
    if n:
        qk, sk, zk = _minmax(k[:n].float().view(n // group, group, c), 1, bits)  # per channel, token groups
        qv, sv, zv = _minmax(v[:n].float().view(n, c // group, group), 2, bits)  # per token, channel groups
        out.update({"k.q": _pack(qk.reshape(n, c), bits).contiguous(), "k.scale": sk.half().contiguous(),
                    "k.zero": zk.half().contiguous(), "v.q": _pack(qv.reshape(n, c), bits).contiguous(),
                    "v.scale": sv.half().contiguous(), "v.zero": zv.half().contiguous()})
    return out


def kivi_dequantize(t: dict[str, torch.Tensor], n_tokens: int, channels: int, bits: int = 4,
                    group: int = KIVI_GROUP, residual: int = KIVI_RESIDUAL) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`kivi_quantize`: keys and values (T, C) fp32."""
    n, c = kivi_split(n_tokens, group, residual), channels
    out = []
    for name, shape in (("k", (n // group, group, c)), ("v", (n, c // group, group))):
        parts = [t[f"{name}.res"].float()]
        if n:
            q = _unpack(t[f"{name}.q"], c, bits).float().view(shape)
            parts.insert(0, (q * t[f"{name}.scale"].float() + t[f"{name}.zero"].float()).reshape(n, c))
        out.append(torch.cat(parts))
    return out[0], out[1]
