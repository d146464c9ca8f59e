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
safetensors (never pickle) with a JSON header (format, model fingerprint, kind, token range, the hash of
the token ids the entry covers — the whole path from the first token to its end (the full chain hash its
key is cut from), not only its own chunk — and the SHA-256 of the tensors' bytes). With a cluster key (``PrefixCacheConfig.remote_key_file``
or ``KVSTATE_REMOTE_KEY``) the header also carries an HMAC-SHA256 over itself, the tensors' digest
included, and a keyed reader refuses any entry without a valid one.

Trust model: without a key the tier is trusted as is (a startup warning says so): the checks catch
accidents and misfiled entries — another document's state copied under this document's keys, another
model's, a truncated, re-encoded (dtype, shape) or non-finite tensor — but a writer with access to Redis
can forge a consistent entry. With a key only holders of the key can write entries a reader uses. An
entry that fails any check is a miss plus a counter (logged once per reason) and is deleted; the request
is computed locally, never answered with a wrong state or an error. A tier that does not answer is a
counted error and the engine serves local-only (``up`` false) until a retry after ``retry_s`` succeeds.

Ignores: a full hit from the remote (the last token is recomputed: no logits row is shared), and
deduplicating writes of chunks another replica already wrote (the write is idempotent).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import struct
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from kvstate.errors import KVStateError
from kvstate.models.families import LayerKind
from kvstate.models.state import CacheSnapshot, LayerSnapshot, RecurrentState
from kvstate.prefix import hashing
from kvstate.prefix.remote import RemoteTier, RemoteUnavailable
from kvstate.prefix.segments import KVSegment, kv_segment

FORMAT = "kvstate-prefix/2"
log = logging.getLogger("kvstate.prefix.shared_tier")


@dataclass(frozen=True)
class RemoteMetrics:
    """An immutable snapshot of the shared tier's counters."""

    up: bool = True  # gauge: the last call to the tier succeeded (False: serving local-only)
    errors: int = 0  # calls that failed (refused, timed out): each turns the tier off for retry_s
    hits: int = 0  # local misses resumed from the remote tier
    misses: int = 0  # local misses the remote tier could not improve on
    corrupt: int = 0  # entries refused: undecodable, bad checksum or HMAC, another model or other tokens,
    # wrong shape / dtype, non-finite values
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


KEY_ENV = "KVSTATE_REMOTE_KEY"
MIN_KEY_BYTES = 16


def load_key(path: str | None) -> bytes | None:
    """The cluster key: the contents of ``path`` (surrounding whitespace stripped), else the environment
    variable ``KVSTATE_REMOTE_KEY``, else None (the tier is trusted as is). A key shorter than 16 bytes, or
    a file that cannot be read, is a KVStateError naming it."""
    import os

    if path is not None:
        try:
            key = Path(path).read_bytes().strip()
        except OSError as exc:
            raise KVStateError(f"remote key file {path!r} cannot be read ({exc.strerror or exc}); pass a readable "
                               "file holding the cluster's shared secret") from None
        where = f"remote key file {path!r}"
    else:
        env = os.environ.get(KEY_ENV)
        if env is None:
            return None
        key, where = env.strip().encode(), f"${KEY_ENV}"
    if len(key) < MIN_KEY_BYTES:
        raise KVStateError(f"{where} holds {len(key)} bytes; the cluster key needs at least {MIN_KEY_BYTES} (e.g. "
                           "`head -c 32 /dev/urandom | base64`), the same on every replica")
    return key


class Corrupt(Exception):
    """A remote entry that must not be used (the reason is the message)."""


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(name.encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _mac(key: bytes, head: dict[str, Any]) -> str:
    body = json.dumps({k: v for k, v in head.items() if k != "mac"}, sort_keys=True).encode()
    return hmac.new(key, body, hashlib.sha256).hexdigest()


def encode(tensors: dict[str, torch.Tensor], header: dict[str, Any], key: bytes | None = None) -> bytes:
    """A checksummed safetensors payload: the tensors plus ``header`` (with their SHA-256, and with ``key``
    an HMAC over the header) as metadata."""
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    head = dict(header, format=FORMAT, sha256=_digest(tensors))
    head.pop("mac", None)
    if key is not None:
        head["mac"] = _mac(key, head)
    return bytes(st_save(tensors, metadata={"kvstate": json.dumps(head, sort_keys=True)}))


def decode(data: bytes, key: bytes | None = None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The tensors and header of a payload; :class:`Corrupt` when it is not one, its checksum fails, or
    (with ``key``) its HMAC is missing or wrong."""
    try:
        (size,) = struct.unpack("<Q", data[:8])
        meta = json.loads(data[8 : 8 + size])["__metadata__"]
        header = json.loads(meta["kvstate"])
        tensors = st_load(data)
    except Exception as exc:  # truncated, not safetensors, no header: all the same to a reader
        raise Corrupt(f"undecodable payload ({type(exc).__name__})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise Corrupt("unknown payload format")
    if key is not None:
        mac = header.get("mac")
        if not isinstance(mac, str) or not hmac.compare_digest(mac, _mac(key, header)):
            raise Corrupt("no valid HMAC (written without the cluster key, or altered)")
    if header.get("sha256") != _digest(tensors):
        raise Corrupt("checksum mismatch")
    return tensors, header


def _finite(name: str, t: torch.Tensor) -> None:
    if not bool(torch.isfinite(t).all()):
        raise Corrupt(f"{name} holds non-finite values")


class SharedTier:
    """One engine's view of the shared tier: keys for its model, write-through, lookup; thread-safe."""

    def __init__(
        self,
        tier: RemoteTier,
        fingerprint: str,
        align: int,
        kinds: list[LayerKind],
        retry_s: float = 1.0,
        key: bytes | None = None,
    ) -> None:
        """``key``: the cluster key entries are signed and checked with (None: the tier is trusted as is)."""
        if key is not None and len(key) < MIN_KEY_BYTES:
            raise KVStateError(f"the shared tier's key holds {len(key)} bytes; pass at least {MIN_KEY_BYTES}")
        if key is None:
            log.warning("shared tier: no cluster key (remote_key_file / $%s): entries in the tier are trusted as "
                        "is; anyone who can write to it can change what this replica serves", KEY_ENV)
        self.tier = tier
        self.key = key
        self._logged: set[str] = set()
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
        return hashing.chain(self.fingerprint, tokens, self.align)

    def kv_key(self, chain: list[bytes], k: int) -> str:
        return f"{self.prefix}:kv:{chain[k].hex()[:40]}"

    def state_hash(self, chain: list[bytes], tokens: Sequence[int], p: int) -> str:
        """The hash of the first ``p`` tokens (the path a state entry covers), extending ``chain``."""
        return hashing.state_hash(chain, tokens, p, self.align)

    def state_key(self, chain: list[bytes], tokens: Sequence[int], p: int) -> str:
        return f"{self.prefix}:st:{self.state_hash(chain, tokens, p)[:40]}"

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
            _finite(f"layer {i} KV", k)
            _finite(f"layer {i} KV", v)
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
            if c is None or r is None or (tuple(c.shape), tuple(r.shape)) != spec[:2]:
                raise Corrupt(f"layer {i} recurrent state has the wrong shape")
            if (c.dtype, r.dtype) != spec[2:]:
                raise Corrupt(f"layer {i} recurrent state has the wrong dtype")
            _finite(f"layer {i} recurrent state", c)
            _finite(f"layer {i} recurrent state", r)
            layers.append(LayerSnapshot(kind, None, RecurrentState(c, r)))
        return CacheSnapshot(p, tuple(layers), has_attention=False)

    def _get(self, key: str, kind: str, start: int, end: int, path: str) -> dict[str, torch.Tensor] | None:
        """The tensors of a valid entry for tokens ``[start, end)`` whose path (every token up to ``end``)
        hashes to ``path``; None when it is missing; raises Corrupt (after deleting the entry) /
        RemoteUnavailable."""
        data = self.tier.get(key)
        if data is None:
            return None
        try:
            tensors, header = decode(data, self.key)
            if header.get("model") != self.fingerprint:
                raise Corrupt("another model's entry")
            if (header.get("kind"), header.get("start"), header.get("end")) != (kind, start, end):
                raise Corrupt("the entry covers another token range")
            if header.get("tokens") != path:
                raise Corrupt("the entry covers other tokens (another document's state under this key)")
        except Corrupt as exc:
            self._refused(key, str(exc))
            raise
        return tensors

    def _refused(self, key: str, reason: str) -> None:
        """Log a refused entry once per reason and delete it (best effort: a writer replaces it anyway)."""
        with self._lock:
            first = reason not in self._logged
            self._logged.add(reason)
        if first:
            log.warning("shared tier: refused entry %s (%s); computing locally", key, reason)
        with contextlib.suppress(RemoteUnavailable):
            self.tier.delete(key)

    def refused(self, reason: str) -> None:
        """Count a resume the engine could not use after the checks passed (logged once per reason)."""
        self._count("corrupt")
        with self._lock:
            first = reason not in self._logged
            self._logged.add(reason)
        if first:
            log.warning("shared tier: could not resume from the tier (%s); computing locally", reason)

    def _checked(self, key: str, check: Any, *args: Any) -> Any:
        """``check(*args)``, refusing (and deleting) entry ``key`` when it raises Corrupt."""
        try:
            return check(*args)
        except Corrupt as exc:
            self._refused(key, str(exc))
            raise

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
                    skey = self.state_key(chain, tokens, p)
                    st = self._get(skey, "state", full * a, p, self.state_hash(chain, tokens, p))
                    if st is None:
                        continue
                    tail = self._checked(skey, self._check_kv, st, p - full * a) \
                        if self.layout.kv and p > full * a else None
                    state = self._checked(skey, self._check_state, st, p) if self.layout.rec else None
                    parts: list[tuple[KVSegment, int]] = []
                    if self.layout.kv:
                        for k in range(1, full + 1):
                            kkey = self.kv_key(chain, k)
                            got = self._get(kkey, "kv", (k - 1) * a, k * a, chain[k].hex())
                            if got is None:
                                raise Corrupt("a KV chunk is missing")
                            parts.append((self._checked(kkey, self._check_kv, got, a), a))
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
                    head = {"model": fp, "kind": "kv", "start": (k - 1) * a, "end": k * a,
                            "tokens": chain[k].hex()}
                    self.tier.put(self.kv_key(chain, k), encode(self._kv_tensors(seg), head, self.key))
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
                        # in the layout's dtypes, which readers insist on (generate may keep another float dtype)
                        spec = self.layout.rec.get(i) if self.layout is not None else None
                        conv, rec = layer.recurrent.conv, layer.recurrent.recurrent
                        if spec is not None:
                            conv, rec = conv.to(spec[2]), rec.to(spec[3])
                        tensors[f"c{i}"], tensors[f"r{i}"] = conv, rec
                head = {"model": fp, "kind": "state", "start": full * a, "end": p, "tokens": self.state_hash(chain, tokens, p)}
                self.tier.put(self.state_key(chain, tokens, p), encode(tensors, head, self.key))
                self._count("puts")
        except RemoteUnavailable:
            self._failed()
            return
        self._ok()
