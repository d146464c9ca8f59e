"""REUSE alone: the SCD codec's low-rank codes of the producer's keys and values at every layer, decoded
into the consumer's K/V space by the layer's linear maps — *Semantic Cache Distillation: Efficient State
Transfer via Reuse and Selective Patching* (``docs/techniques.md#across-models``) with no PATCH layer.
Given a producer-space PCA codec of the same pair (``MethodContext.pca_codec``) the bench adds its
ablation row ``reuse_pca_producer``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from kvstate.transfer.methods.base import MethodContext, TransferMethod
from kvstate.transfer.payload import Payload


@dataclass(frozen=True, eq=False)
class CodecMethod(TransferMethod):
    """A method whose payloads are the codec's own (pair = the codec's identity; the codec checks them)."""

    def pair(self, ctx: MethodContext) -> bytes:
        return ctx.codec.pair

    def patch(self, ctx: MethodContext) -> tuple[int, ...] | None:
        return ()

    def encode(self, producer: Any, ids: torch.Tensor, ctx: MethodContext) -> Payload:
        return ctx.codec.encode(producer, ids, patch=self.patch(ctx), check=False)

    def decode(self, consumer: Any, payload: Payload, ids: Sequence[int] | None, ctx: MethodContext) -> Any:
        return ctx.codec.decode(consumer, payload, ids, check=False)


@dataclass(frozen=True, eq=False)
class Reuse(CodecMethod):
    name: str = "reuse"
    order: int = 60
    summary: str = "SCD's REUSE codes at every layer (linear low-rank maps), no PATCH"

    def bench_rows(self, ctx: MethodContext, extended: bool = True) -> dict[str, MethodContext]:
        pca = {} if ctx.pca_codec is None else {"reuse_pca_producer": replace(ctx, codec=ctx.pca_codec, pca_codec=None)}
        return {**pca, self.name: ctx}


METHODS = (Reuse(),)
