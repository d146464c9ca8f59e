"""Baselines for cross-model state transfer, shipped in the same wire format as SCD payloads.

Compared against *Semantic Cache Distillation: Efficient State Transfer via Reuse and Selective
Patching* (``docs/techniques.md#across-models``):

- ``raw``: the producer's keys and values in fp16, used by the consumer as they are.
- ``kv4bit``: the same at 4 bits after *KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache*
  (keys per channel, values per token; keys quantized before rotary, where their channels are stable).
- ``droidspeak``: after *DroidSpeak: KV Cache Sharing for Cross-LLM Communication and Multi-LLM
  Serving*: raw K/V for every layer outside one contiguous block of critical layers ``[a, b)``; for
  the block the producer ships its residual stream entering layer ``a`` (fp16) and the consumer
  recomputes the block's layers with its own weights.

Ignored: KIVI's full-precision recent window; DroidSpeak's per-pair block search (the block comes from
the codec's calibration).
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from transformers import DynamicCache

from kvstate.transfer.payload import Payload, PayloadError, ids_hash
from kvstate.transfer.quant import kivi_dequantize, kivi_quantize
from kvstate.transfer.states import build_cache, capture_inputs, geometry, project_kv, rotary

METHODS = ("raw", "kv4bit", "droidspeak")


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
        if method == "kv4bit":
            out.update({f"{i}.{n}": x for n, x in kivi_quantize(k, v).items()})
        else:
            out[f"k.{i}"], out[f"v.{i}"] = k.half(), v.half()
    if method == "droidspeak":
        out["resid"] = resid[a][0].half()  # (T, hidden): residual stream entering layer a
    meta = {"method": method, "block": f"{a},{b}"}
    return Payload(pair, t, ids_hash(input_ids[0].tolist()), out, meta)


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
        if method == "kv4bit":
            parts = {n: payload.tensor(f"{i}.{n}") for n in ("k.q", "k.scale", "k.zero", "v.q", "v.scale", "v.zero")}
            for n in ("k.q", "v.q"):
                payload.tensor(f"{i}.{n}", (t, (c + 1) // 2), torch.uint8)
            payload.tensor(f"{i}.k.scale", (1, c))
            payload.tensor(f"{i}.v.scale", (t, 1))
            k, v = kivi_dequantize(parts, c)
        else:
            k, v = (payload.tensor(f"{n}.{i}", (t, c), torch.float16).float() for n in ("k", "v"))
        keys[i], values[i] = k.view(t, g.n_kv_heads, g.head_dim), v.view(t, g.n_kv_heads, g.head_dim)
    if method == "droidspeak":
        h = payload.tensor("resid", (t, g.hidden_size), torch.float16)[None].to(next(consumer.parameters()).dtype)
        cos, sin = rotary(consumer, torch.arange(t))
        with capture_inputs(consumer, "attn") as got:
            for i in range(a, b):
                h = consumer.model.layers[i](h, attention_mask=None, position_ids=torch.arange(t)[None],
                                             position_embeddings=(cos, sin))
                keys[i], values[i] = project_kv(consumer, i, got[i][0])
    for x in (*keys, *values):
        if x is None or not torch.isfinite(x).all():
            raise PayloadError("baseline payload decodes to missing or non-finite K/V")
    return build_cache(consumer, keys, values)  # type: ignore[arg-type]
