"""Both ends of disaggregated serving with SCD: the producer's encode service and the consumer's generate.

*Semantic Cache Distillation: Efficient State Transfer via Reuse and Selective Patching*
(``docs/techniques.md#across-models``). The producer prefills every prompt prefix except its last token
and ships the payload; the consumer decodes it into its own ``DynamicCache``, runs the last prompt token
itself (it needs that token's logits) and continues with ``model.generate``. Both ends bound what they
take by the model: the producer's vocabulary and positions (every request), the consumer's positions
(prompt + new tokens). Ignored: sampling, batches.
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
from kvstate.validate import check_float, check_id_list, check_int


def positions(model: Any) -> int | None:
    """The model's ``max_position_embeddings`` (None when its config has none)."""
    limit = getattr(model.config, "max_position_embeddings", None)
    return limit if isinstance(limit, int) and not isinstance(limit, bool) else None


def producer_service(producer: Any, codec: Codec, store: PayloadStore) -> ProducerService:
    """A :class:`ProducerService` that encodes with ``codec`` on ``producer`` (fingerprints checked once)."""
    codec.check_models(producer=producer)

    def encode(ids: list[int]) -> Any:
        with torch.inference_mode():
            return codec.encode(producer, torch.tensor([ids], dtype=torch.long), check=False)

    info = {"producer": codec.producer_fp, "consumer": codec.consumer_fp, "patch_layers": list(codec.config.patch_layers)}
    return ProducerService(encode, codec.pair, store, info, vocab_size=int(producer.config.vocab_size),
                           max_tokens=positions(producer))


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
    if not isinstance(prompt, str):
        raise KVStateError(f"prompt must be text, got {type(prompt).__name__}")
    limit = positions(consumer)
    check_int("--max-new-tokens", max_new_tokens, 1, limit if limit is not None else 1 << 20, error=KVStateError,
              hint=" (at most the consumer's positions)")
    check_float("--timeout", timeout, 0.0, 86400.0, lo_open=True, error=KVStateError)
    ids = tokenizer(prompt)["input_ids"]
    if len(ids) < 2:
        raise KVStateError(f"--prompt {prompt!r} has {len(ids)} token(s); a transfer needs at least 2")
    if limit is not None and len(ids) + max_new_tokens > limit:
        raise KVStateError(f"--prompt of {len(ids):,} tokens + --max-new-tokens {max_new_tokens:,} exceeds the "
                           f"consumer's max_position_embeddings={limit:,}; shorten the prompt or pass "
                           f"--max-new-tokens <= {max(0, limit - len(ids)):,}")
    check_id_list("--prompt token ids", list(ids), int(consumer.config.vocab_size), error=KVStateError)
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
