"""Both ends of disaggregated serving with SCD: the producer's encode service and the consumer's generate.

*Semantic Cache Distillation: Efficient State Transfer via Reuse and Selective Patching*
(``docs/techniques.md#across-models``). The producer prefills every prompt prefix except its last token
and ships the payload; the consumer decodes it into its own ``DynamicCache``, runs the last prompt token
itself (it needs that token's logits) and continues with ``model.generate``. Ignored: sampling, batches.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from kvstate.errors import KVStateError
from kvstate.transfer.codec import Codec
from kvstate.transfer.store import PayloadStore
from kvstate.transfer.transport import ProducerService, fetch_payload


def producer_service(producer: Any, codec: Codec, store: PayloadStore) -> ProducerService:
    """A :class:`ProducerService` that encodes with ``codec`` on ``producer`` (fingerprints checked once)."""
    codec.check_models(producer=producer)

    def encode(ids: list[int]) -> Any:
        with torch.inference_mode():
            return codec.encode(producer, torch.tensor([ids], dtype=torch.long), check=False)

    info = {"producer": codec.producer_fp, "consumer": codec.consumer_fp, "patch_layers": list(codec.config.patch_layers)}
    return ProducerService(encode, codec.pair, store, info)


@dataclass(frozen=True)
class Generation:
    text: str  # decoded new tokens
    new_tokens: int
    payload_bytes: int
    prompt_tokens: int
    wire_ms: float  # request sent -> payload received (loopback or network)
    decode_ms: float  # payload -> consumer cache
    generate_ms: float  # last prompt token + new tokens on the consumer
    cached: bool  # the producer answered from its store


def consumer_generate(consumer: Any, tokenizer: Any, codec: Codec, server: str, prompt: str,
                      max_new_tokens: int = 32, timeout: float = 60.0) -> Generation:
    """Fetch the prompt prefix's payload from ``server`` and greedily continue it on ``consumer``."""
    ids = tokenizer(prompt)["input_ids"]
    if len(ids) < 2:
        raise KVStateError(f"--prompt {prompt!r} has {len(ids)} token(s); a transfer needs at least 2")
    codec.check_models(consumer=consumer)
    payload, head = fetch_payload(server, ids[:-1], codec.pair, timeout)
    t0 = time.perf_counter()
    cache = codec.decode(consumer, payload, ids, check=False)
    t1 = time.perf_counter()
    with torch.inference_mode():
        out = consumer.generate(torch.tensor([ids]), cache=cache, max_new_tokens=max_new_tokens, do_sample=False,
                                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    t2 = time.perf_counter()
    new = out[0, len(ids):].tolist()
    return Generation(tokenizer.decode(new, skip_special_tokens=True), len(new), int(head["bytes"]), len(ids),
                      float(head["wire_ms"]), 1e3 * (t1 - t0), 1e3 * (t2 - t1), bool(head["cached"]))
