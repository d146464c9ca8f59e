"""Raw KV reuse: the producer's keys and values in fp16 (``raw``) or fp32 (``raw_fp32``), used by the
consumer as they are — the premise baseline of *Semantic Cache Distillation: Efficient State Transfer
via Reuse and Selective Patching* (``docs/techniques.md#across-models``). Keys travel before rotary, so
the consumer applies its own positions."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvstate.transfer.methods.base import MethodContext, TransferMethod, producer_states
from kvstate.transfer.payload import Payload, PayloadError, ids_hash
from kvstate.transfer.states import build_cache, geometry


def finite_cache(consumer: Any, keys: Sequence[torch.Tensor | None], values: Sequence[torch.Tensor | None]) -> Any:
    """The consumer's cache from per-layer (T, H_kv, D) keys / values; a missing or non-finite one is a
    :class:`PayloadError`."""
    for x in (*keys, *values):
        if x is None or not bool(torch.isfinite(x).all()):
            raise PayloadError("payload decodes to missing or non-finite K/V")
    return build_cache(consumer, list(keys), list(values))  # type: ignore[arg-type]


@dataclass(frozen=True, eq=False)
class RawKV(TransferMethod):
    name: str = "raw"
    dtype: torch.dtype = torch.float16
    order: int = 10
    summary: str = "the producer's K/V in fp16, used by the consumer as they are"

    def encode(self, producer: Any, ids: torch.Tensor, ctx: MethodContext) -> Payload:
        keys, values, _ = producer_states(producer, ids)
        out: dict[str, torch.Tensor] = {}
        for i in keys:
            out[f"k.{i}"], out[f"v.{i}"] = keys[i].to(self.dtype).contiguous(), values[i].to(self.dtype).contiguous()
        return Payload(self.pair(ctx), ids.shape[1], ids_hash(ids[0].tolist()), out, {"method": self.name})

    def decode(self, consumer: Any, payload: Payload, ids: Sequence[int] | None, ctx: MethodContext) -> Any:
        self.check_payload(payload, ids, ctx)
        g, t = geometry(consumer), payload.n_tokens
        c = g.n_kv_heads * g.head_dim
        with torch.inference_mode():
            kv = [[payload.tensor(f"{n}.{i}", (t, c), self.dtype).float().view(t, g.n_kv_heads, g.head_dim)
                   for i in range(g.n_layers)] for n in ("k", "v")]
        return finite_cache(consumer, kv[0], kv[1])


METHODS = (RawKV(), RawKV(name="raw_fp32", dtype=torch.float32, order=20,
                          summary="the producer's K/V in fp32, used by the consumer as they are"))
