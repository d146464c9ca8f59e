"""The protocol every transfer method implements: encode on the producer, decode on the consumer.

For *Semantic Cache Distillation: Efficient State Transfer via Reuse and Selective Patching*
(``docs/techniques.md#across-models``) and its baselines. A method is one object (one file under
:mod:`kvstate.transfer.methods`) registered by name; the producer's server, the consumer's generate,
the quality bench and the TTFT bench all reach it only through :class:`TransferMethod`:

- :meth:`TransferMethod.encode` prefills ``ids`` (1, T) on the producer and returns a
  :class:`~kvstate.transfer.payload.Payload` (the wire format every method shares, so bytes count alike);
- :meth:`TransferMethod.decode` turns a payload into the consumer's ``DynamicCache`` of its tokens;
- :meth:`TransferMethod.recomputed_layers` names the consumer layers it runs itself (DroidSpeak's block,
  every layer for the oracle), :func:`payload_bytes_per_token` is measured from the serialised payload;
- :meth:`TransferMethod.profile` is an optional offline step that needs both models (DroidSpeak's block
  search) and returns the options it chose; :meth:`TransferMethod.bench_rows` the extra bench rows
  (SCD's PATCH budget).

Everything a method needs beyond the two models travels in a :class:`MethodContext`: the codec (the
pair's identity and, for SCD, its maps), the codec's directory (where a method may keep its own trained
artifacts) and string options (``--option KEY=VALUE`` on the command line; a method names the keys it
takes and any other key is refused).
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from kvstate.errors import KVStateError
from kvstate.transfer.codec import Codec
from kvstate.transfer.payload import Payload, PayloadError
from kvstate.transfer.states import capture_inputs, geometry, project_kv


class MethodError(KVStateError):
    """An unknown transfer method, or options it does not take."""


@dataclass(frozen=True)
class MethodContext:
    """What a method is used with: the pair's codec, its directory, string options and (for the REUSE
    ablation) a producer-space PCA codec of the same pair."""

    codec: Codec
    codec_dir: Path | None = None
    options: Mapping[str, str] = field(default_factory=dict)
    pca_codec: Codec | None = None

    def with_options(self, **options: str) -> MethodContext:
        return replace(self, options={**self.options, **options})

    def option(self, key: str) -> str | None:
        return self.options.get(key)


def raw_pair(producer_fp: str, consumer_fp: str) -> bytes:
    """Pair fingerprint of codec-free payloads: the two models only."""
    return hashlib.sha256(f"{producer_fp}|{consumer_fp}|raw".encode()).digest()


def payload_bytes_per_token(payload: Payload) -> float:
    """Bytes on the wire per token of state: the serialised payload (header, checksum, tensors, metadata)
    over the tokens it carries."""
    return len(payload.to_bytes()) / max(1, payload.n_tokens)


def tensor_bytes(payload: Payload) -> int:
    """Bytes of the payload's tensors alone (what the format's framing adds to is the rest)."""
    return sum(t.numel() * t.element_size() for t in payload.tensors.values())


class TransferMethod(ABC):
    """One transfer method. Subclasses set ``name``, ``summary`` and ``order`` (the table position) and
    implement :meth:`encode` / :meth:`decode`; the defaults fit a method with no options and no
    consumer-side recompute whose payloads carry the pair of raw (codec-free) payloads."""

    name: str = ""
    summary: str = ""  # one line for `kvstate transfer methods` and the docs
    order: int = 100  # position in tables (oracle 0, baselines 10-50, codec methods 60-80, new methods > 100)
    ships_payload: bool = True  # False: nothing goes over the wire (the oracle prefills on the consumer)
    option_keys: tuple[str, ...] = ()  # the --option keys it takes
    calibration_prefixes: int = 4  # calibration-stream prefixes its profile() fits on (a method that trains asks for more)

    # --- identity and options -------------------------------------------------------------------
    def check(self, ctx: MethodContext) -> None:
        """Raise :class:`MethodError` on an option this method does not take or cannot parse."""
        bad = sorted(set(ctx.options) - set(self.option_keys))
        if bad:
            takes = f"it takes {', '.join(self.option_keys)}" if self.option_keys else "it takes none"
            raise MethodError(f"--method {self.name} takes no option {', '.join(bad)} ({takes})")

    def pair(self, ctx: MethodContext) -> bytes:
        """The pair fingerprint its payloads carry (codec-free methods: the two models' fingerprints)."""
        return raw_pair(ctx.codec.producer_fp, ctx.codec.consumer_fp)

    def variant(self, ctx: MethodContext) -> str:
        """The store's name for what a server ships with these options: the method's name, and with options a
        digest of them — a file-valued option (a trained artifact) by the file's content, so two option sets, or
        a retrained artifact at the same path, never share a key. Always a valid store-key variant (paths,
        ``:`` and ``=`` never reach the key)."""
        if not ctx.options:
            return self.name
        h = hashlib.sha256()
        for k in sorted(ctx.options):
            v = ctx.options[k]
            p = Path(v)
            h.update(f"{k}\0{v}\0".encode())
            if p.is_file():
                h.update(hashlib.sha256(p.read_bytes()).digest())
        return f"{self.name}.{h.hexdigest()[:16]}"

    def recomputed_layers(self, ctx: MethodContext) -> tuple[int, ...]:
        """The consumer layers this method runs itself on the transferred prefix (none by default)."""
        return ()

    # --- the two ends -----------------------------------------------------------------------------
    @abstractmethod
    def encode(self, producer: Any, ids: torch.Tensor, ctx: MethodContext) -> Payload:
        """Prefill ``ids`` (1, T) on the producer and return the payload."""

    @abstractmethod
    def decode(self, consumer: Any, payload: Payload, ids: Sequence[int] | None, ctx: MethodContext) -> Any:
        """The consumer's cache of the payload's tokens (raises :class:`PayloadError` on a payload that does
        not fit: another pair, method or tokens, missing tensors)."""

    # --- optional hooks ---------------------------------------------------------------------------
    def profile(self, producer: Any, consumer: Any, prompts: list[torch.Tensor],
                ctx: MethodContext) -> tuple[dict[str, str], dict[str, Any]]:
        """Offline choice of options on dev prompts with both models: (options, what was measured)."""
        return {}, {}

    def bench_rows(self, ctx: MethodContext, extended: bool = True) -> dict[str, MethodContext]:
        """The bench rows of this method: name -> context (``extended``: ablation / budget rows too)."""
        return {self.name: ctx}

    # --- helpers for subclasses -------------------------------------------------------------------
    def check_payload(self, payload: Payload, ids: Sequence[int] | None, ctx: MethodContext) -> None:
        if not isinstance(payload, Payload):
            raise PayloadError(f"decode: expected a Payload, got {type(payload).__name__}")
        payload.check(self.pair(ctx), ids)
        got = payload.meta.get("method")
        if got != self.name:
            raise PayloadError(f"payload was encoded by method {got!r}; this consumer decodes {self.name!r} "
                               f"(pass --method {got} on both ends)")


_SHARED: list[dict[tuple[int, bytes], Any]] = []  # open shared_prefill() scopes, innermost last


@contextmanager
def shared_prefill() -> Iterator[None]:
    """Inside the ``with``, :func:`producer_states` prefills each (producer, ids) once and every method that
    encodes those ids reuses it (item-major benches: one producer prefill per item shared by every method).
    Nothing is kept after the ``with``."""
    _SHARED.append({})
    try:
        yield
    finally:
        _SHARED.pop()


def producer_states(producer: Any, ids: torch.Tensor, skip: Sequence[int] = (),
                    ) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """From one prefill of ``ids`` (1, T): the producer's pre-rotary keys and values of every layer not in
    ``skip``, each (T, H_kv * D) fp32, and its residual stream entering each layer (T, hidden). Inside
    :func:`shared_prefill` the prefill of the same producer and ids is done once."""
    if _SHARED:
        memo = _SHARED[-1]
        key = (id(producer), ids.detach().cpu().numpy().tobytes() + str(tuple(ids.shape)).encode())
        if key not in memo:
            memo[key] = _producer_states(producer, ids, ())
        keys, values, resid = memo[key]
        drop = set(skip)
        return ({i: k for i, k in keys.items() if i not in drop}, {i: v for i, v in values.items() if i not in drop},
                resid)
    return _producer_states(producer, ids, skip)


def _producer_states(producer: Any, ids: torch.Tensor, skip: Sequence[int],
                     ) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    g, t = geometry(producer), ids.shape[1]
    with torch.inference_mode():
        with capture_inputs(producer, "attn") as h_in, capture_inputs(producer, "layer") as resid:
            producer(input_ids=ids, position_ids=torch.arange(t)[None], use_cache=False)
        keys, values = {}, {}
        for i in range(g.n_layers):
            if i in skip:
                continue
            k, v = project_kv(producer, i, h_in[i][0])
            keys[i], values[i] = k.reshape(t, -1).float(), v.reshape(t, -1).float()
    return keys, values, {i: r[0] for i, r in resid.items()}
