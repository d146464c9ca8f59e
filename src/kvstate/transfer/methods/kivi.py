"""*KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache* as a transfer baseline, at 4 bits
(``kivi4``) and 2 bits (``kivi2``): keys per channel over groups of 32 tokens, values per token over groups
of 32 channels, the most recent >= 128 tokens in fp16 (:func:`kvstate.transfer.quant.kivi_quantize`; keys
quantized before rotary, where their channels are stable). Compared against *Semantic Cache Distillation*
(``docs/techniques.md#across-models``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvstate.transfer.methods.base import MethodContext, TransferMethod, producer_states
from kvstate.transfer.methods.raw import finite_cache
from kvstate.transfer.payload import Payload, ids_hash
from kvstate.transfer.quant import KIVI_GROUP, kivi_dequantize, kivi_quantize, kivi_split
from kvstate.transfer.states import geometry


@dataclass(frozen=True, eq=False)
class Kivi(TransferMethod):
    name: str = "kivi4"
    bits: int = 4
    order: int = 30
    summary: str = "KIVI 4-bit K/V (per-channel keys, per-token values, fp16 recent window)"

    def encode(self, producer: Any, ids: torch.Tensor, ctx: MethodContext) -> Payload:
        keys, values, _ = producer_states(producer, ids)
        out: dict[str, torch.Tensor] = {}
        for i in keys:
            out.update({f"{i}.{n}": x for n, x in kivi_quantize(keys[i], values[i], self.bits).items()})
        return Payload(self.pair(ctx), ids.shape[1], ids_hash(ids[0].tolist()), out, {"method": self.name})

    def decode(self, consumer: Any, payload: Payload, ids: Sequence[int] | None, ctx: MethodContext) -> Any:
        self.check_payload(payload, ids, ctx)
        g, t = geometry(consumer), payload.n_tokens
        c, n, grp = g.n_kv_heads * g.head_dim, kivi_split(t), KIVI_GROUP
        shapes = {"k.res": ((t - n, c), torch.float16), "v.res": ((t - n, c), torch.float16)}
        if n:
            packed = (n, -(-c // (8 // self.bits)))
            shapes.update({"k.q": (packed, torch.uint8), "v.q": (packed, torch.uint8),
                           "k.scale": ((n // grp, 1, c), torch.float16), "k.zero": ((n // grp, 1, c), torch.float16),
                           "v.scale": ((n, c // grp, 1), torch.float16), "v.zero": ((n, c // grp, 1), torch.float16)})
        keys, values = [], []
        with torch.inference_mode():
            for i in range(g.n_layers):
                parts = {name: payload.tensor(f"{i}.{name}", shape, dtype) for name, (shape, dtype) in shapes.items()}
                k, v = kivi_dequantize(parts, t, c, self.bits)
                keys.append(k.view(t, g.n_kv_heads, g.head_dim))
                values.append(v.view(t, g.n_kv_heads, g.head_dim))
        return finite_cache(consumer, keys, values)


METHODS = (Kivi(), Kivi(name="kivi2", bits=2, order=40,
                        summary="KIVI 2-bit K/V (per-channel keys, per-token values, fp16 recent window)"))
