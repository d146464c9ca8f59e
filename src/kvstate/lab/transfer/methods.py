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


def parse_block(value: str | None, codec: Codec, option: str = "--block") -> tuple[int, int] | None:
    """DroidSpeak's block ``A:B`` (layers ``[A, B)``, ``0 <= A < B <= layers``) from an option; ``None`` stays
    ``None`` (the whole stack)."""
    if value is None:
        return None
    n = codec.geometry.n_layers
    try:
        a, b = (int(x) for x in value.split(":"))
    except ValueError:
        raise KVStateError(f"{option} {value!r} is not A:B (DroidSpeak recomputes layers A..B-1), e.g. {option} "
                           f"1:{n}") from None
    if not 0 <= a < b <= n:
        raise KVStateError(f"{option} {value!r}: need 0 <= A < B <= {n} (the codec's layers), e.g. {option} 1:{n}")
    return a, b


def variant(method: str, block: tuple[int, int] | None) -> str:
    """The store's name for what a server ships: the method, and DroidSpeak's block when one is set (payloads
    of two blocks never share a key)."""
    return f"{method}.{block[0]}-{block[1]}" if method == "droidspeak" and block is not None else method


def encoder(method: str, producer: Any, codec: Codec, block: tuple[int, int] | None = None,
            ) -> tuple[bytes, Callable[[torch.Tensor], Payload]]:
    """(pair, encode ids (1, T) -> payload) of ``method`` on ``producer``; fingerprint checked against ``codec``.

    ``block`` is DroidSpeak's recomputed layer block ``[a, b)`` (default :func:`whole_stack`); another method
    given a block is refused."""
    check_method(method)
    if block is not None and method != "droidspeak":
        raise KVStateError(f"--block is DroidSpeak's recomputed layer block; --method {method} takes none")
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
