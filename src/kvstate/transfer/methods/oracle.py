"""The oracle: the consumer's own prefill of the whole prompt. Nothing goes over the wire and every layer
is recomputed; the reference every transfer method of *Semantic Cache Distillation: Efficient State
Transfer via Reuse and Selective Patching* (``docs/techniques.md#across-models``) is scored against, and
a rival on every TTFT-vs-quality front."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from kvstate.transfer.methods.base import MethodContext, MethodError, TransferMethod
from kvstate.transfer.payload import Payload


@dataclass(frozen=True, eq=False)
class Oracle(TransferMethod):
    name: str = "oracle"
    order: int = 0
    summary: str = "the consumer's own prefill (nothing shipped, every layer recomputed)"
    ships_payload: bool = False

    def recomputed_layers(self, ctx: MethodContext) -> tuple[int, ...]:
        return tuple(range(ctx.codec.geometry.n_layers))

    def encode(self, producer: Any, ids: torch.Tensor, ctx: MethodContext) -> Payload:
        raise MethodError("--method oracle ships no payload (the consumer prefills the prompt itself); pick a "
                          "transfer method to serve")

    def decode(self, consumer: Any, payload: Payload | None, ids: Sequence[int] | None, ctx: MethodContext) -> Any:
        """The consumer's own cache of all but the last of ``ids`` (the payload, if any, is ignored)."""
        if ids is None or len(ids) < 2:
            raise MethodError("the oracle needs the prompt ids (at least 2 tokens) to prefill them itself")
        cache = DynamicCache(config=consumer.config)
        t = len(ids) - 1
        with torch.inference_mode():
            consumer(input_ids=torch.tensor([list(ids[:t])]), position_ids=torch.arange(t)[None], cache=cache,
                     use_cache=True)
        return cache


METHODS = (Oracle(),)
