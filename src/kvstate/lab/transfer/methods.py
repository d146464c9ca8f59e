"""The transfer methods a producer serves and a consumer decodes, by name: both ends of one method.

For serving *Semantic Cache Distillation: Efficient State Transfer via Reuse and Selective Patching*
(``docs/techniques.md#across-models``) and its baselines over the wire (``kvstate transfer serve /
generate --method``, the TTFT bench): ``scd`` (REUSE + PATCH at the codec's layers), ``reuse`` (REUSE
codes at every layer) and every baseline of :mod:`kvstate.lab.transfer.baselines` (raw KV, 4-bit KV,
DroidSpeak). The codec names the pair for all of them: baselines are keyed by its two fingerprints, so
a producer needs no consumer weights and a consumer no producer weights. Ignored: per-request method
choice (one method per server; the method is part of the store key).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kvstate.errors import KVStateError
from kvstate.lab.transfer import baselines
from kvstate.transfer.codec import Codec
from kvstate.transfer.payload import Payload
from kvstate.transfer.serving import Receiver, codec_receiver

CODEC_METHODS = ("reuse", "scd")  # the codec's own encodings: no PATCH layers / its calibrated PATCH layers


def served_methods() -> tuple[str, ...]:
    """Every method a producer can serve: the baselines, then the codec's."""
    return (*baselines.METHODS, *CODEC_METHODS)


def check_method(method: str) -> str:
    if method not in served_methods():
        raise KVStateError(f"--method {method!r} is not a transfer method; pick one of {', '.join(served_methods())}")
    return method


def whole_stack(codec: Codec) -> tuple[int, int]:
    """DroidSpeak's block when none is given: every layer. Its offline profiling
    (:func:`kvstate.lab.transfer.bench.droidspeak_profile`, recorded as ``droidspeak_block`` in the bench's
    results) needs both models; on the committed pair no smaller block met its quality bound."""
    return 0, codec.geometry.n_layers


def encoder(method: str, producer: Any, codec: Codec, block: tuple[int, int] | None = None,
            ) -> tuple[bytes, Callable[[torch.Tensor], Payload]]:
    """(pair, encode ids (1, T) -> payload) of ``method`` on ``producer``; fingerprint checked against ``codec``.

    ``block`` is DroidSpeak's recomputed layer block ``[a, b)`` (default :func:`whole_stack`)."""
    check_method(method)
    codec.check_models(producer=producer)
    if method in CODEC_METHODS:
        patch = () if method == "reuse" else None
        return codec.pair, lambda ids: codec.encode(producer, ids, patch=patch, check=False)
    pair, span = baselines.raw_pair(codec.producer_fp, codec.consumer_fp), block or whole_stack(codec)
    return pair, lambda ids: baselines.encode_baseline(method, producer, ids, pair, span)


def receiver(method: str, consumer: Any, codec: Codec) -> Receiver:
    """How ``consumer`` decodes ``method``'s payloads; fingerprint checked against ``codec``."""
    check_method(method)
    if method in CODEC_METHODS:
        return codec_receiver(consumer, codec)
    codec.check_models(consumer=consumer)
    pair = baselines.raw_pair(codec.producer_fp, codec.consumer_fp)
    return Receiver(pair, lambda payload, _ids: baselines.decode_baseline(consumer, payload, pair))
