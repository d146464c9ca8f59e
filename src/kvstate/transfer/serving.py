"""Both ends of disaggregated serving with SCD: the producer's encode service and the consumer's generate.

*Semantic Cache Distillation: Efficient State Transfer via Reuse and Selective Patching*
(``docs/techniques.md#across-models``). The producer prefills every prompt prefix except its last token
and ships the payload; the consumer decodes it into its own ``DynamicCache``, runs the last prompt token
itself (it needs that token's logits) and continues with ``model.generate``. Both ends bound what they
take by the model: the producer's vocabulary and positions (every request), the consumer's positions
(prompt + new tokens). A :class:`Receiver` says which payloads a consumer accepts and how it decodes them
(the codec's by default; the lab builds receivers for the baselines). When the producer cannot serve
(:class:`~kvstate.transfer.transport.ProducerUnavailable`) or its payload is refused (corrupt, for other
tokens, undecodable: :class:`~kvstate.transfer.payload.PayloadError`) the consumer prefills the prompt
itself and says so (``Generation.fallback``, one line); a producer serving another model pair is a
configuration error and is raised. Ignored: sampling, batches.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvstate.errors import KVStateError
from kvstate.transfer.codec import Codec
from kvstate.transfer.gate import GateConfig, GateRefused, read_gate
from kvstate.transfer.payload import Payload, PayloadError
from kvstate.transfer.store import PayloadStore
from kvstate.transfer.transport import ProducerService, ProducerUnavailable, fetch_payload
from kvstate.validate import check_float, check_id_list, check_int


def positions(model: Any) -> int | None:
    """The model's ``max_position_embeddings`` (None when its config has none)."""
    limit = getattr(model.config, "max_position_embeddings", None)
    return limit if isinstance(limit, int) and not isinstance(limit, bool) else None


def producer_service(producer: Any, codec: Codec, store: PayloadStore,
                     encode: Callable[[torch.Tensor], Payload] | None = None, pair: bytes | None = None,
                     variant: str = "") -> ProducerService:
    """A :class:`ProducerService` that encodes with ``codec`` on ``producer`` (fingerprints checked once);
    ``encode`` (ids (1, T) -> payload) and ``pair`` replace the codec's own encoding (e.g. a baseline),
    ``variant`` names it in the store's keys."""
    codec.check_models(producer=producer)
    if (encode is None) != (pair is None):
        raise KVStateError("producer_service: pass encode and pair together (or neither: the codec's own)")

    def run(ids: list[int]) -> Any:
        with torch.inference_mode():
            x = torch.tensor([ids], dtype=torch.long)
            return codec.encode(producer, x, check=False) if encode is None else encode(x)

    info = {"producer": codec.producer_fp, "consumer": codec.consumer_fp, "patch_layers": list(codec.config.patch_layers),
            "variant": variant}
    return ProducerService(run, codec.pair if pair is None else pair, store, info,
                           vocab_size=int(producer.config.vocab_size), max_tokens=positions(producer), variant=variant)


@dataclass(frozen=True)
class Receiver:
    """What a consumer accepts and how it decodes it."""

    pair: bytes  # the pair fingerprint its payloads must carry
    decode: Callable[[Payload, Sequence[int]], Any]  # (payload, prompt ids) -> consumer cache of payload.n_tokens


def codec_receiver(consumer: Any, codec: Codec) -> Receiver:
    """The consumer's side of ``codec`` (its fingerprint checked once)."""
    codec.check_models(consumer=consumer)
    return Receiver(codec.pair, lambda payload, ids: codec.decode(consumer, payload, ids, check=False))


@dataclass(frozen=True)
class Generation:
    text: str  # decoded new tokens
    new_tokens: int
    payload_bytes: int
    prompt_tokens: int
    wire_ms: float  # request sent -> payload received (loopback or network)
    decode_ms: float  # payload -> consumer cache
    generate_ms: float  # last prompt token + new tokens on the consumer (the whole prompt after a fallback)
    cached: bool  # the producer answered from its store
    fallback: str | None = None  # why the consumer prefilled the prompt itself (None: it used the payload)
    gate_error: float | None = None  # the gate's reading of the decoded cache (None: no gate)
    gate_ms: float = 0.0  # what the gate's check cost


def consumer_generate(consumer: Any, tokenizer: Any, codec: Codec | Receiver, server: str, prompt: str,
                      max_new_tokens: int = 32, timeout: float = 60.0, fallback: bool = True,
                      gate: GateConfig | None = None) -> Generation:
    """Fetch the prompt prefix's payload from ``server`` and greedily continue it on ``consumer``.

    ``codec``: the codec (or a :class:`Receiver`) the payload is decoded with. ``fallback``: when the
    producer cannot serve (:class:`ProducerUnavailable`) or its payload is refused (:class:`PayloadError`),
    prefill the prompt on the consumer and give the reason in ``Generation.fallback`` (False: raise).
    ``gate``: check the decoded cache first (:mod:`kvstate.transfer.gate`); a cache the gate refuses is a
    fallback like a refused payload."""
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
    receiver = codec_receiver(consumer, codec) if isinstance(codec, Codec) else codec
    reading, gate_ms = None, 0.0
    try:
        payload, head = fetch_payload(server, ids[:-1], receiver.pair, timeout)
        t0 = time.perf_counter()
        cache = receiver.decode(payload, ids)
        if gate is not None and len(ids) > 3:
            tg = time.perf_counter()
            reading = read_gate(consumer, cache, torch.tensor([ids[:-1]]), gate)
            gate_ms = 1e3 * (time.perf_counter() - tg)
            if not reading.accept:
                raise GateRefused(f"the gate refused the transferred cache (K/V error {reading.error:.3f} > "
                                  f"{gate.max_error:g})")
    except (ProducerUnavailable, PayloadError, GateRefused) as exc:
        if not fallback:
            raise
        t0 = time.perf_counter()
        new = _generate(consumer, tokenizer, ids, None, max_new_tokens)
        why = f"{exc}; prefilled on the consumer instead"
        return Generation(tokenizer.decode(new, skip_special_tokens=True), len(new), 0, len(ids), 0.0, 0.0,
                          1e3 * (time.perf_counter() - t0), False, fallback=" ".join(why.split()),
                          gate_error=None if reading is None else reading.error, gate_ms=gate_ms)
    t1 = time.perf_counter()
    new = _generate(consumer, tokenizer, ids, cache, max_new_tokens)
    t2 = time.perf_counter()
    return Generation(tokenizer.decode(new, skip_special_tokens=True), len(new), int(head["bytes"]), len(ids),
                      float(head["wire_ms"]), 1e3 * (t1 - t0), 1e3 * (t2 - t1), bool(head["cached"]),
                      gate_error=None if reading is None else reading.error, gate_ms=gate_ms)


@torch.inference_mode()
def _generate(consumer: Any, tokenizer: Any, ids: list[int], cache: Any, max_new_tokens: int) -> list[int]:
    """Greedy new tokens after ``ids``, from ``cache`` (holding all but the last prompt token) or from nothing."""
    extra = {} if cache is None else {"cache": cache}
    out = consumer.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id, **extra)
    return list(out[0, len(ids):].tolist())
