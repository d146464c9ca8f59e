"""Baselines for cross-model state transfer, shipped in the same wire format as SCD payloads.

Compared against *Semantic Cache Distillation: Efficient State Transfer via Reuse and Selective
Patching* (``docs/techniques.md#across-models``), each at its paper's strength:

- ``raw`` / ``raw_fp32``: the producer's keys and values in fp16 / fp32, used by the consumer as they are.
- ``kivi4`` / ``kivi2``: *KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache* at 4 / 2 bits:
  keys per channel over groups of 32 tokens, values per token over groups of 32 channels, the most
  recent >= 128 tokens in fp16 (:func:`kvstate.transfer.quant.kivi_quantize`; keys quantized before
  rotary, where their channels are stable).
- ``droidspeak``: *DroidSpeak: KV Cache Sharing for Cross-LLM Communication and Multi-LLM Serving*:
  raw K/V for every layer outside one contiguous block ``[a, b)``; for the block the producer ships its
  residual stream entering layer ``a`` (fp16, the paper's E cache) and the consumer recomputes the
  block with its own weights. The block comes from the paper's offline profiling: every contiguous
  block is tried on dev prefixes (:func:`profile_blocks`, the consumer's next-token KL) and the
  smallest block that removes the quality loss to within a tolerance is kept (:func:`choose_block`).

Ignored: DroidSpeak's pipelining of E-cache and KV loading (a latency optimisation, not a quality one).
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from transformers import DynamicCache

from kvstate.models.rotary import rotary_tables
from kvstate.transfer.payload import Payload, PayloadError, ids_hash
from kvstate.transfer.quant import KIVI_GROUP, kivi_dequantize, kivi_quantize, kivi_split
from kvstate.transfer.states import build_cache, capture_inputs, continue_logits, geometry, project_kv

METHODS = ("raw", "raw_fp32", "kivi4", "kivi2", "droidspeak")
KIVI_BITS = {"kivi4": 4, "kivi2": 2}


def raw_pair(producer_fp: str, consumer_fp: str) -> bytes:
    """Pair fingerprint of codec-free payloads: the two models only."""
    return hashlib.sha256(f"{producer_fp}|{consumer_fp}|raw".encode()).digest()


@torch.inference_mode()
def encode_baseline(method: str, producer: Any, input_ids: torch.Tensor, pair: bytes,
                    block: tuple[int, int] = (0, 1)) -> Payload:
    """Prefill on the producer and ship its state the ``method`` way (``block``: droidspeak's [a, b))."""
    if method not in METHODS:
        raise ValueError(f"baseline method {method!r} must be one of {METHODS}")
    g, t = geometry(producer), input_ids.shape[1]
    a, b = block
    if not 0 <= a < b <= g.n_layers:
        raise ValueError(f"droidspeak block {block} must satisfy 0 <= a < b <= {g.n_layers}")
    with capture_inputs(producer, "attn") as h_in, capture_inputs(producer, "layer") as resid:
        producer(input_ids=input_ids, position_ids=torch.arange(t)[None], use_cache=False)
    out: dict[str, torch.Tensor] = {}
    for i in range(g.n_layers):
        if method == "droidspeak" and a <= i < b:
            continue
        k, v = project_kv(producer, i, h_in[i][0])
        k, v = k.reshape(t, -1).float(), v.reshape(t, -1).float()  # (T, H*D)
        if method in KIVI_BITS:
            out.update({f"{i}.{n}": x for n, x in kivi_quantize(k, v, KIVI_BITS[method]).items()})
        elif method == "raw_fp32":
            out[f"k.{i}"], out[f"v.{i}"] = k.contiguous(), v.contiguous()
        else:
            out[f"k.{i}"], out[f"v.{i}"] = k.half(), v.half()
    if method == "droidspeak":
        out["resid"] = resid[a][0].half()  # (T, hidden): residual stream entering layer a
    meta = {"method": method, "block": f"{a},{b}"}
    return Payload(pair, t, ids_hash(input_ids[0].tolist()), out, meta)


def _kivi_parts(payload: Payload, layer: int, t: int, c: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's keys and values (T, C) from a KIVI payload, every tensor's shape checked."""
    n, g = kivi_split(t), KIVI_GROUP
    shapes = {"k.res": ((t - n, c), torch.float16), "v.res": ((t - n, c), torch.float16)}
    if n:
        packed = (n, -(-c // (8 // bits)))
        shapes.update({"k.q": (packed, torch.uint8), "v.q": (packed, torch.uint8),
                       "k.scale": ((n // g, 1, c), torch.float16), "k.zero": ((n // g, 1, c), torch.float16),
                       "v.scale": ((n, c // g, 1), torch.float16), "v.zero": ((n, c // g, 1), torch.float16)})
    parts = {name: payload.tensor(f"{layer}.{name}", shape, dtype) for name, (shape, dtype) in shapes.items()}
    return kivi_dequantize(parts, t, c, bits)


@torch.inference_mode()
def decode_baseline(consumer: Any, payload: Payload, pair: bytes) -> DynamicCache:
    """The consumer's cache from a baseline payload (raises :class:`PayloadError` on a mismatch)."""
    payload.check(pair)
    g, t = geometry(consumer), payload.n_tokens
    method = payload.meta.get("method")
    if method not in METHODS:
        raise PayloadError(f"payload method {method!r} is not a baseline ({METHODS})")
    try:
        a, b = (int(x) for x in payload.meta.get("block", "").split(","))
    except ValueError:
        raise PayloadError(f"payload block {payload.meta.get('block')!r} is not 'a,b'") from None
    if not 0 <= a < b <= g.n_layers:
        raise PayloadError(f"payload block [{a}, {b}) out of range for {g.n_layers} layers")
    c = g.n_kv_heads * g.head_dim
    keys: list[torch.Tensor | None] = [None] * g.n_layers
    values: list[torch.Tensor | None] = [None] * g.n_layers
    for i in range(g.n_layers):
        if method == "droidspeak" and a <= i < b:
            continue
        if method in KIVI_BITS:
            k, v = _kivi_parts(payload, i, t, c, KIVI_BITS[method])
        else:
            dtype = torch.float32 if method == "raw_fp32" else torch.float16
            k, v = (payload.tensor(f"{n}.{i}", (t, c), dtype).float() for n in ("k", "v"))
        keys[i], values[i] = k.view(t, g.n_kv_heads, g.head_dim), v.view(t, g.n_kv_heads, g.head_dim)
    if method == "droidspeak":
        h = payload.tensor("resid", (t, g.hidden_size), torch.float16)[None].to(next(consumer.parameters()).dtype)
        cos, sin = rotary_tables(consumer, torch.arange(t))
        with capture_inputs(consumer, "attn") as got:
            for i in range(a, b):
                h = consumer.model.layers[i](h, attention_mask=None, position_ids=torch.arange(t)[None],
                                             position_embeddings=(cos, sin))
                keys[i], values[i] = project_kv(consumer, i, got[i][0])
    for x in (*keys, *values):
        if x is None or not torch.isfinite(x).all():
            raise PayloadError("baseline payload decodes to missing or non-finite K/V")
    return build_cache(consumer, keys, values)  # type: ignore[arg-type]


def _kl(ref: torch.Tensor, test: torch.Tensor) -> float:
    lp, lq = torch.log_softmax(ref.double(), -1), torch.log_softmax(test.double(), -1)
    return float((lp.exp() * (lp - lq)).sum(-1).mean())


@torch.inference_mode()
def profile_blocks(producer: Any, consumer: Any, prompts: list[torch.Tensor], pair: bytes,
                   suffix: int = 16) -> dict[tuple[int, int], float]:
    """DroidSpeak's offline profiling: for every contiguous block ``[a, b)`` (and ``(0, 0)`` = raw reuse,
    nothing recomputed) the consumer's mean next-token KL on the last ``suffix`` tokens of ``prompts``
    against its own prefill."""
    n = geometry(consumer).n_layers
    blocks = [(0, 0)] + [(a, b) for a in range(n) for b in range(a + 1, n + 1)]
    out = {blk: 0.0 for blk in blocks}
    for ids in prompts:
        cut = ids.shape[1] - suffix
        ref = continue_logits(consumer, None, ids, 0)[cut:]
        for blk in blocks:
            method, block = ("raw", (0, 1)) if blk == (0, 0) else ("droidspeak", blk)
            pl = encode_baseline(method, producer, ids[:, :cut], pair, block)
            out[blk] += _kl(ref, continue_logits(consumer, decode_baseline(consumer, pl, pair), ids, cut)) / len(prompts)
    return out


def choose_block(kl: dict[tuple[int, int], float], keep: float = 0.25) -> tuple[int, int]:
    """The smallest contiguous block whose KL is at most ``keep`` x raw reuse's (``kl[(0, 0)]``), the lowest KL
    among equals; if none is, the whole stack. DroidSpeak's choice of recompute layers under a quality bound."""
    if not 0.0 <= keep < 1.0:
        raise ValueError(f"choose_block: keep={keep} must be in [0, 1)")
    raw = kl[(0, 0)]
    ok = [(b - a, v, a, b) for (a, b), v in kl.items() if b > a and v <= keep * raw]
    if not ok:
        return max(((a, b) for a, b in kl if b > a), key=lambda blk: (blk[1] - blk[0], -kl[blk]))
    _, _, a, b = min(ok)
    return a, b
