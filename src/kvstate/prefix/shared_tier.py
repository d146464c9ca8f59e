"""The prefix cache's shared tier (torch glue): what goes to the remote store, under which keys, and back.

Sparse prefix caching ("Sparse Prefix Caching for Hybrid and Recurrent LLM Serving") across replicas,
laid out like SGLang's HiCache / LMCache remote backends: on commit a replica writes the attention KV
of the chunks it computed and the recurrent states it captured through to one remote tier
(:mod:`kvstate.prefix.remote`); on a local miss another replica reads them back and resumes there.

Keys are content-addressed: a hash chain over the request's token chunks (the store's grid, ``align``
tokens each) seeded with the model's fingerprint, under one Redis Cluster hash tag per model
(``kvstate:{<fp16>}:kv:<chain hash>`` for the KV of chunk ``k``, ``kvstate:{<fp16>}:st:<hash>`` for the
state after ``p`` tokens, which also carries the KV of the ``p mod align`` tokens past the last full
chunk), so a cluster shards per model and any replica of the same model finds them. Payloads are
safetensors (never pickle) with a JSON header (format, model fingerprint, kind, token range, tensor
shapes and dtypes, and the SHA-256 of the tensors' bytes). An entry that is missing, evicted, truncated,
of another model, of the wrong shape or with a bad checksum is a miss plus a counter, never a wrong
state; a tier that does not answer is a counted error and the engine serves local-only (``up`` false)
until a retry after ``retry_s`` succeeds.

Ignores: a full hit from the remote (the last token is recomputed: no logits row is shared), and
deduplicating writes of chunks another replica already wrote (the write is idempotent).
"""

from __future__ import annotations

import hashlib
import json
import struct
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from kvstate.models.families import LayerKind
from kvstate.models.state import CacheSnapshot, LayerSnapshot, RecurrentState
from kvstate.prefix.remote import RemoteTier, RemoteUnavailable
from kvstate.prefix.segments import KVSegment, kv_segment

FORMAT = "kvstate-prefix/1"


@dataclass(frozen=True)
class RemoteMetrics:
    """An immutable snapshot of the shared tier's counters."""

    up: bool = True  # gauge: the last call to the tier succeeded (False: serving local-only)
    errors: int = 0  # calls that failed (refused, timed out): each turns the tier off for retry_s
    hits: int = 0  # local misses resumed from the remote tier
    misses: int = 0  # local misses the remote tier could not improve on
    corrupt: int = 0  # entries refused: undecodable, bad checksum, another model, wrong shapes
    puts: int = 0  # entries written
    tokens_reused: int = 0  # tokens restored from the remote tier beyond the local hit


@dataclass(frozen=True)
class Layout:
    """Per-layer tensor shapes (token dimension as -1) and dtypes this model's states have."""

    kv: dict[int, tuple[tuple[int, ...], torch.dtype]]  # attention layer -> ((1, H, -1, D), dtype)
    rec: dict[int, tuple[tuple[int, ...], tuple[int, ...], torch.dtype, torch.dtype]]  # conv, ssm shapes/dtypes


def layout_of(kv: KVSegment | None, state: CacheSnapshot | None) -> Layout:
    """The layout of a model's states, read off a KV segment and a recurrent snapshot it computed."""
    kvl: dict[int, tuple[tuple[int, ...], torch.dtype]] = {}
    rec: dict[int, tuple[tuple[int, ...], tuple[int, ...], torch.dtype, torch.dtype]] = {}
    for i, pair in enumerate(kv.layers if kv is not None else ()):
        if pair is not None:
            shape = list(pair[0].shape)
            shape[-2] = -1
            kvl[i] = (tuple(shape), pair[0].dtype)
    for i, layer in enumerate(state.layers if state is not None else ()):
        if layer.recurrent is not None:
            r = layer.recurrent
            rec[i] = (tuple(r.conv.shape), tuple(r.recurrent.shape), r.conv.dtype, r.recurrent.dtype)
    return Layout(kvl, rec)


class Corrupt(Exception):
    """A remote entry that must not be used (the reason is the message)."""


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(name.encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def encode(tensors: dict[str, torch.Tensor], header: dict[str, Any]) -> bytes:
    """A checksummed safetensors payload: the tensors plus ``header`` (with their SHA-256) as metadata."""
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    head = dict(header, format=FORMAT, sha256=_digest(tensors))
    return bytes(st_save(tensors, metadata={"kvstate": json.dumps(head, sort_keys=True)}))


def decode(data: bytes) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The tensors and header of a payload; :class:`Corrupt` when it is not one or its checksum fails."""
    try:
        (size,) = struct.unpack("<Q", data[:8])
        meta = json.loads(data[8 : 8 + size])["__metadata__"]
        header = json.loads(meta["kvstate"])
        tensors = st_load(data)
    except Exception as exc:  # truncated, not safetensors, no header: all the same to a reader
        raise Corrupt(f"undecodable payload ({type(exc).__name__})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise Corrupt("unknown payload format")
    if header.get("sha256") != _digest(tensors):
        raise Corrupt("checksum mismatch")
    return tensors, header


class SharedTier:
    """One engine's view of the shared tier: keys for its model, write-through, lookup; thread-safe."""

    def __init__(
        self, tier: RemoteTier, fingerprint: str, align: int, kinds: list[LayerKind], retry_s: float = 1.0
    ) -> None:
        self.tier = tier
        self.fingerprint = fingerprint
        self.align = int(align)
        self.kinds = kinds
        self.retry_s = float(retry_s)
        self.prefix = f"kvstate:{{{fingerprint[:16]}}}"  # one Redis Cluster hash tag per model
        self.layout: Layout | None = None  # this model's own shapes (the engine sets it): no read without
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._m: dict[str, Any] = {k: v for k, v in RemoteMetrics().__dict__.items()}

    # -- metrics ------------------------------------------------------------------------------------
    def metrics(self) -> RemoteMetrics:
        with self._lock:
            return RemoteMetrics(**self._m)

    def _count(self, name: str, k: int = 1) -> None:
        with self._lock:
            self._m[name] += k

    def _available(self) -> bool:
        with self._lock:
            return time.monotonic() >= self._down_until

    def _failed(self) -> None:
        with self._lock:
            self._m["errors"] += 1
            self._m["up"] = False
            self._down_until = time.monotonic() + self.retry_s

    def _ok(self) -> None:
        with self._lock:
            self._m["up"] = True

    # -- keys ---------------------------------------------------------------------------------------
    def chain(self, tokens: Sequence[int]) -> list[bytes]:
        """``h[k]``: the hash of the first ``k`` chunks (``h[0]`` the model's fingerprint)."""
        out = [hashlib.sha256(self.fingerprint.encode()).digest()]
        a = self.align
        for k in range(len(tokens) // a):
            chunk = struct.pack(f"<{a}q", *tokens[k * a : (k + 1) * a])
            out.append(hashlib.sha256(out[-1] + chunk).digest())
        return out

    def kv_key(self, chain: list[bytes], k: int) -> str:
        return f"{self.prefix}:kv:{chain[k].hex()[:40]}"

    def state_key(self, chain: list[bytes], tokens: Sequence[int], p: int) -> str:
        full = p // self.align
        tail = struct.pack(f"<{p - full * self.align}q", *tokens[full * self.align : p])
        return f"{self.prefix}:st:{hashlib.sha256(chain[full] + tail + struct.pack('<q', p)).hexdigest()[:40]}"

    # -- payloads -----------------------------------------------------------------------------------
    def _kv_tensors(self, seg: KVSegment) -> dict[str, torch.Tensor]:
        out = {}
        for i, pair in enumerate(seg.layers):
            if pair is not None:
                out[f"k{i}"], out[f"v{i}"] = pair
        return out

    def _check_kv(self, tensors: dict[str, torch.Tensor], length: int) -> KVSegment:
        assert self.layout is not None
        layers: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(self.kinds)
        for i, (shape, dtype) in self.layout.kv.items():
            want = tuple(length if d == -1 else d for d in shape)
            k, v = tensors.get(f"k{i}"), tensors.get(f"v{i}")
            if k is None or v is None or tuple(k.shape) != want or tuple(v.shape) != want:
                raise Corrupt(f"layer {i} KV has the wrong shape")
            if k.dtype != dtype or v.dtype != dtype:
                raise Corrupt(f"layer {i} KV has the wrong dtype")
            layers[i] = (k, v)
        return KVSegment(tuple(layers), length)

    def _check_state(self, tensors: dict[str, torch.Tensor], p: int) -> CacheSnapshot:
        assert self.layout is not None
        layers = []
        for i, kind in enumerate(self.kinds):
            spec = self.layout.rec.get(i)
            if spec is None:
                layers.append(LayerSnapshot(kind))
                continue
            c, r = tensors.get(f"c{i}"), tensors.get(f"r{i}")
            if c is None or r is None or (tuple(c.shape), tuple(r.shape)) != spec[:2] or not (
                c.dtype.is_floating_point and r.dtype.is_floating_point
            ):
                raise Corrupt(f"layer {i} recurrent state has the wrong shape or dtype")
            layers.append(LayerSnapshot(kind, None, RecurrentState(c, r)))
        return CacheSnapshot(p, tuple(layers), has_attention=False)

    def _get(self, key: str, kind: str, start: int, end: int) -> dict[str, torch.Tensor] | None:
        """The tensors of a valid entry, None when it is missing; raises Corrupt / RemoteUnavailable."""
        data = self.tier.get(key)
        if data is None:
            return None
        tensors, header = decode(data)
        if header.get("model") != self.fingerprint:
            raise Corrupt("another model's entry")
        if (header.get("kind"), header.get("start"), header.get("end")) != (kind, start, end):
            raise Corrupt("the entry covers other tokens")
        return tensors

    # -- the two verbs ------------------------------------------------------------------------------
    def lookup(
        self, tokens: Sequence[int], local: int, candidates: Iterable[int]
    ) -> tuple[int, list[tuple[KVSegment, int]], CacheSnapshot | None] | None:
        """The deepest candidate position past ``local`` the tier holds in full (state + every KV chunk
        before it): ``(p, KV parts, recurrent state)``; None on a miss (counted) or when the tier is down."""
        cands = sorted((p for p in set(candidates) if local < p < len(tokens)), reverse=True)
        if not cands or self.layout is None or not self._available():
            return None
        a = self.align
        try:
            chain = self.chain(tokens)
            for p in cands:
                full = p // a
                try:
                    st = self._get(self.state_key(chain, tokens, p), "state", full * a, p)
                    if st is None:
                        continue
                    tail = self._check_kv(st, p - full * a) if self.layout.kv and p > full * a else None
                    state = self._check_state(st, p) if self.layout.rec else None
                    parts: list[tuple[KVSegment, int]] = []
                    if self.layout.kv:
                        for k in range(1, full + 1):
                            got = self._get(self.kv_key(chain, k), "kv", (k - 1) * a, k * a)
                            if got is None:
                                raise Corrupt("a KV chunk is missing")
                            parts.append((self._check_kv(got, a), a))
                        if tail is not None:
                            parts.append((tail, tail.length))
                except Corrupt:
                    self._count("corrupt")
                    continue
                self._ok()
                with self._lock:
                    self._m["hits"] += 1
                    self._m["tokens_reused"] += p - local
                return p, parts, state
        except RemoteUnavailable:
            self._failed()
            return None
        self._ok()
        self._count("misses")
        return None

    def write(
        self, tokens: Sequence[int], start: int, live: Any, states: dict[int, CacheSnapshot], upto: int
    ) -> None:
        """Write through what a pass computed: the KV chunks ending past ``start`` and within ``upto``
        tokens (from the ``live`` cache), and each captured state with its tail KV."""
        has_att = any(k in (LayerKind.ATTENTION, LayerKind.HYBRID) for k in self.kinds)
        if not self._available():
            return
        a = self.align
        chain = self.chain(tokens[:upto])
        fp = self.fingerprint
        try:
            if has_att:
                for k in range(start // a + 1, upto // a + 1):
                    seg = kv_segment(live, (k - 1) * a, k * a, self.kinds, "cpu")
                    head = {"model": fp, "kind": "kv", "start": (k - 1) * a, "end": k * a}
                    self.tier.put(self.kv_key(chain, k), encode(self._kv_tensors(seg), head))
                    self._count("puts")
            for p, snap in states.items():
                if not 0 < p <= upto:
                    continue
                full = p // a
                tensors: dict[str, torch.Tensor] = {}
                if has_att and p > full * a:
                    tensors |= self._kv_tensors(kv_segment(live, full * a, p, self.kinds, "cpu"))
                for i, layer in enumerate(snap.layers):
                    if layer.recurrent is not None:
                        tensors[f"c{i}"], tensors[f"r{i}"] = layer.recurrent.conv, layer.recurrent.recurrent
                head = {"model": fp, "kind": "state", "start": full * a, "end": p}
                self.tier.put(self.state_key(chain, tokens, p), encode(tensors, head))
                self._count("puts")
        except RemoteUnavailable:
            self._failed()
            return
        self._ok()
