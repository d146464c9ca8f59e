"""The wire format of a transferred state: a versioned, checksummed binary (fixed header + safetensors body).

What a producer of *Semantic Cache Distillation: Efficient State Transfer via Reuse and Selective
Patching* ships to a consumer (and what the raw / 4-bit / recompute baselines ship, so all are counted
the same way). Layout, big-endian::

    magic "KVSP" | version u16 | flags u16 | n_tokens u32 | pair fingerprint 32 B | token-ids hash 32 B
    | body length u64 | SHA-256 of (everything before it + body) 32 B | body (safetensors bytes)

The body holds the per-layer code tensors and a string metadata map (canonical JSON in a uint8 tensor,
so equal payloads serialise to equal bytes). Any mismatch — wrong magic or
version, truncation, a flipped bit, a payload for another model pair or other tokens — raises
:class:`PayloadError`, never a silently wrong cache. No pickle: safetensors only.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from kvstate.errors import KVStateError

MAGIC = b"KVSP"
FORMAT_VERSION = 1
_HEAD = struct.Struct(">4sHHI32s32sQ")  # everything the checksum follows
HEADER_BYTES = _HEAD.size + 32
META = "__meta__"  # body tensor holding the metadata (uint8 JSON)
MAX_BODY_BYTES = 1 << 31  # 2 GiB: a larger length field is a corrupt header, not a payload


class PayloadError(KVStateError):
    """A payload that cannot be used: malformed, corrupted, another version, or for another model pair / tokens."""


def ids_hash(token_ids: Sequence[int]) -> bytes:
    """SHA-256 of the token ids (int64 little-endian): which prefix a payload encodes."""
    return hashlib.sha256(torch.as_tensor(list(token_ids), dtype=torch.int64).numpy().astype("<i8").tobytes()).digest()


@dataclass(frozen=True)
class Payload:
    pair: bytes  # 32 B fingerprint of (producer, consumer, codec): who may decode it
    n_tokens: int  # tokens of state carried
    token_hash: bytes  # ids_hash of those tokens
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # per-layer codes and scales
    meta: dict[str, str] = field(default_factory=dict)  # method, bits, layer modes
    version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        if len(self.pair) != 32 or len(self.token_hash) != 32:
            raise PayloadError("Payload: pair and token_hash must be 32-byte SHA-256 digests")
        if not 0 <= self.n_tokens < 2**32:
            raise PayloadError(f"Payload: n_tokens={self.n_tokens} must be in [0, 2^32)")
        if not self.tensors or META in self.tensors:
            raise PayloadError(f"Payload: needs at least one tensor, none named {META!r}")

    def to_bytes(self) -> bytes:
        # the metadata travels as a tensor of canonical JSON: safetensors' own metadata map has no fixed order
        meta = torch.frombuffer(bytearray(json.dumps(self.meta, sort_keys=True).encode()), dtype=torch.uint8)
        body = st_save({**{k: v.contiguous() for k, v in self.tensors.items()}, META: meta})
        head = _HEAD.pack(MAGIC, self.version, 0, self.n_tokens, self.pair, self.token_hash, len(body))
        return head + hashlib.sha256(head + body).digest() + body

    @classmethod
    def from_bytes(cls, data: bytes) -> Payload:
        """Parse and verify; raises :class:`PayloadError` on anything but a well-formed payload."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise PayloadError(f"payload must be bytes, got {type(data).__name__}")
        data = bytes(data)
        if len(data) < HEADER_BYTES:
            raise PayloadError(f"payload truncated: {len(data)} bytes, the header alone is {HEADER_BYTES}")
        magic, version, _flags, n_tokens, pair, thash, body_len = _HEAD.unpack_from(data)
        if magic != MAGIC:
            raise PayloadError(f"not a kvstate payload (magic {magic!r}, expected {MAGIC!r})")
        if version != FORMAT_VERSION:
            raise PayloadError(f"payload format version {version}; this kvstate reads version {FORMAT_VERSION} "
                               "— re-encode it with a matching kvstate")
        if body_len > MAX_BODY_BYTES or len(data) != HEADER_BYTES + body_len:
            raise PayloadError(f"payload truncated or padded: header says {body_len} body bytes, "
                               f"got {len(data) - HEADER_BYTES}")
        body = data[HEADER_BYTES:]
        if hashlib.sha256(data[:_HEAD.size] + body).digest() != data[_HEAD.size:HEADER_BYTES]:
            raise PayloadError("payload checksum mismatch: corrupted in transit or storage")
        try:
            tensors = st_load(body)
            meta = json.loads(tensors.pop(META).numpy().tobytes())
        except Exception as exc:  # a checksummed body that still does not parse: written by something else
            raise PayloadError(f"payload body is not valid safetensors: {exc}") from None
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            raise PayloadError("payload metadata must map strings to strings")
        return cls(pair, n_tokens, thash, tensors, meta, version)

    def check(self, pair: bytes, token_ids: Sequence[int] | None = None) -> None:
        """Raise :class:`PayloadError` unless this payload is for ``pair`` (and the first n_tokens of ``token_ids``)."""
        if self.pair != pair:
            raise PayloadError(f"payload is for model pair {self.pair.hex()[:12]}…, this codec/consumer is "
                               f"{pair.hex()[:12]}…; use the codec calibrated for this producer and consumer")
        if token_ids is not None and (
                len(token_ids) < self.n_tokens or ids_hash(list(token_ids)[: self.n_tokens]) != self.token_hash):
            raise PayloadError(f"payload encodes other tokens than the prompt's first {self.n_tokens}; "
                               "request a payload for this prompt")

    def tensor(self, name: str, shape: Sequence[int] | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A body tensor, checked for presence, shape and dtype (raises :class:`PayloadError`)."""
        t = self.tensors.get(name)
        if t is None:
            raise PayloadError(f"payload lacks tensor {name!r}")
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise PayloadError(f"payload tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(shape)}")
        if dtype is not None and t.dtype != dtype:
            raise PayloadError(f"payload tensor {name!r} has dtype {t.dtype}, expected {dtype}")
        return t
