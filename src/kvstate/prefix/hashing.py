"""Content hashes of token prefixes, the one home of the scheme the shared tier's keys and the cache events use.

Sparse prefix caching ("Sparse Prefix Caching for Hybrid and Recurrent LLM Serving") names what it stores by
content, as vLLM's prefix-cache block hashes and SGLang's radix keys do: ``chain(seed, tokens, align)[k]``
is a SHA-256 chain over the first ``k`` blocks of ``align`` tokens (little-endian int64), seeded with the
model's fingerprint, so equal hashes mean the same model and the same tokens; :func:`state_hash` extends it
to any position (the blocks before it, the tail, and the position). Pure: ints and bytes only.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence


def chain(seed: str, tokens: Sequence[int], align: int) -> list[bytes]:
    """``h[k]``: the hash of the first ``k`` blocks of ``tokens`` (``h[0]`` the seed's hash)."""
    out = [hashlib.sha256(seed.encode()).digest()]
    for k in range(len(tokens) // align):
        block = struct.pack(f"<{align}q", *tokens[k * align : (k + 1) * align])
        out.append(hashlib.sha256(out[-1] + block).digest())
    return out


def state_hash(hashes: list[bytes], tokens: Sequence[int], p: int, align: int) -> str:
    """The hash of the first ``p`` tokens, extending ``hashes`` (a :func:`chain` covering them), in hex."""
    full = p // align
    tail = struct.pack(f"<{p - full * align}q", *tokens[full * align : p])
    return hashlib.sha256(hashes[full] + tail + struct.pack("<q", p)).hexdigest()


def path_hash(seed: str, tokens: Sequence[int]) -> str:
    """The hash of one whole token path (``seed`` then every token, little-endian int64), in hex: what a cache
    the local store hands out records, so that inserting it under other tokens is refused."""
    h = hashlib.sha256(seed.encode())
    h.update(struct.pack("<q", len(tokens)))
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return h.hexdigest()
