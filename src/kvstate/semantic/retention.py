"""Query-agnostic retention x a quantized tier: SEKV at 16:1 of bf16 memory.

Two factors the public 16:1 results combine, each near-lossless alone (``docs/techniques.md#resolution``, issue 48):

- **retention scored by context reconstruction** (after KVzip, "Query-Agnostic KV Cache Compression with Context
  Reconstruction", arXiv 2505.23416): after the context's prefill the model is fed "Repeat the previous context
  exactly." followed by the context itself, and every context token's score in a KV head is the most attention any
  of the reconstruction's queries (over the head's query group) gives it (:func:`reconstruction_scores`). The
  question is never seen, so one compression serves every question asked of the context. Tokens are kept by one
  ranking over every layer and KV head (KVzip's non-uniform budget, :func:`allocate`), the attention sinks and the
  recent window always;
- **the kept tokens stored at a few bits** (KIVI-style, :mod:`kvstate.semantic.quant`): keys per channel in groups
  of ``group`` kept tokens of a head, values per token; the sinks, the recent window and every token fed after
  compression at full precision (:class:`RetainedStore`).

The budget (:class:`RetentionConfig`) is **memory against a bf16 full cache** of the context, everything counted:
codes, every range, the exact anchors; the count of kept tokens is the most whose exact bytes fit it. What is held
is what a pass reads (attention over every kept token): resident = total = attended. Use::

    cache = retain(model, tokenizer, context_ids)              # RetentionConfig(): 0.0625 of bf16, 4 bits
    with semantic_attention(model):
        model.generate(torch.cat([context_ids, question_ids], 1), cache=cache, max_new_tokens=32)

The defaults are the configuration of the real-model 16:1 runs (``python -m kvstate.lab.semantic.realmodel16``:
the registry's ``sekv_zip``). Ignored: KVzip's chunked scoring of long contexts (one pass over the whole context
here, ``chunk`` queries at a time) and its chat-template repeat prompt; a fused kernel reading codes (the
dequantized kept tokens are kept between passes, not counted as held).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AttentionInterface

from kvstate.errors import BudgetError, KVStateError
from kvstate.models.compat import AttentionMaskInterface, attn_implementation, sdpa_mask
from kvstate.semantic.bounds import key_bounds
from kvstate.semantic.cache import SemanticCache
from kvstate.semantic.config import SemanticConfig
from kvstate.semantic.quant import QuantKeys, QuantValues, quantize_keys, quantize_values
from kvstate.semantic.segment import SegmentConfig

FLOAT_BYTES = 2  # the memory budget's unit: bf16
GROUP = 32  # kept tokens of a head per key quantization group
REPEAT = "\n\nRepeat the previous context exactly.\n"
CHUNK = 512  # reconstruction queries per forward call
SCORER = "kvzip_score"


# --- scoring: the most attention each context token receives while the model reconstructs the context -----------

class _Scores:
    def __init__(self, context_len: int) -> None:
        self.t = context_len
        self.by_layer: dict[int, torch.Tensor] = {}  # layer -> (H_kv, T) running max


_ACTIVE: list[_Scores] = []


def _scoring_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                       **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Causal attention that also keeps, per KV head, the most probability any query gives each context key."""
    rec = _ACTIVE[-1]
    _, hq, tq, d = query.shape
    h, tk = key.shape[1], key.shape[2]
    g = hq // h
    scale = scaling if scaling is not None else d ** -0.5
    q = query[0].reshape(h, g * tq, d)
    logits = q @ key[0].transpose(-1, -2) * scale  # (H, g*Tq, Tk)
    causal = (torch.arange(tk)[None, :] > torch.arange(tk - tq, tk)[:, None]).repeat(g, 1)
    p = torch.softmax(logits.float().masked_fill(causal, float("-inf")), -1)
    got = p[:, :, :rec.t].amax(1)  # (H, T)
    i = int(module.layer_idx)
    rec.by_layer[i] = torch.maximum(rec.by_layer[i], got) if i in rec.by_layer else got
    out = (p.to(value.dtype) @ value[0]).reshape(1, hq, tq, d)
    return out.transpose(1, 2).contiguous(), None


@torch.no_grad()
def reconstruction_scores(model: Any, tokenizer: Any, prefilled: Any, context: list[int],
                          chunk: int = CHUNK) -> dict[int, torch.Tensor]:
    """Per attention layer, (H_kv, T): each context token's largest attention from the reconstruction's queries
    (:data:`REPEAT` then the context, fed ``chunk`` tokens a call after a copy of ``prefilled``, a cache holding
    exactly the context at full resolution; it is left unchanged)."""
    if prefilled.get_seq_length() != len(context):
        raise KVStateError(f"reconstruction_scores: the cache holds {prefilled.get_seq_length()} tokens, the context "
                           f"{len(context)}; pass the cache prefilled with exactly this context")
    AttentionInterface.register(SCORER, _scoring_attention)
    AttentionMaskInterface.register(SCORER, sdpa_mask)
    cache = copy.deepcopy(prefilled, memo={id(model.config): model.config})
    ids = tokenizer.encode(REPEAT, add_special_tokens=False) + list(context)
    t = len(context)
    rec = _Scores(t)
    old = attn_implementation(model.config)
    _ACTIVE.append(rec)
    model.set_attn_implementation(SCORER)
    try:
        for a in range(0, len(ids), chunk):
            part = torch.tensor([ids[a:a + chunk]])
            pos = torch.arange(t + a, t + a + part.shape[1])[None]
            model(input_ids=part, position_ids=pos, cache=cache, use_cache=True)
    finally:
        model.set_attn_implementation(old)
        _ACTIVE.pop()
    return rec.by_layer


def _anchor_logits(query: torch.Tensor, anchor_k: torch.Tensor, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped queries ``(H, g*Tq, D)`` of ``query`` (1, Hq, Tq, D) and their causal logits against the anchors
    ``anchor_k`` (1, H, A, D), whose last ``Tq`` are the fed tokens: ``(H, g*Tq, A)``."""
    q = query[0]
    hq, tq, d = q.shape
    h = anchor_k.shape[1]
    g = hq // h
    qg = q.reshape(h, g * tq, d)
    a = anchor_k.shape[2]
    causal = (torch.arange(a)[None, :] > torch.arange(a - tq, a)[:, None]).repeat(g, 1)
    return qg, (qg @ anchor_k[0].transpose(-1, -2) * scaling).masked_fill(causal, float("-inf"))


# --- the store: exact anchors + the kept tokens quantized, per KV head ------------------------------------------

def kept_nbytes(n: int, d: int, k_bits: int, v_bits: int, element_size: int, group: int = GROUP) -> int:
    """Bytes of ``n`` kept tokens of one head: key and value codes, each value's range, each key group's range
    (16 bits: the raw K/V)."""
    if k_bits >= 16:
        return 2 * n * d * element_size
    rows = -(-d * k_bits // 8) + -(-d * v_bits // 8)
    return n * (rows + 2 * element_size) + -(-n // group) * 2 * d * element_size


@dataclass
class RetainedHead:
    """One KV head's kept tokens: key groups (codes, lo, hi) and values (or raw K/V at 16 bits)."""

    q_k: list[tuple[QuantKeys, torch.Tensor, torch.Tensor]]
    q_v: QuantValues | None
    raw_k: torch.Tensor | None  # (n, D) at 16 bits
    raw_v: torch.Tensor | None
    n: int


@dataclass
class RetainedStore:
    anchor_k: torch.Tensor  # (1, H, A, D) sinks + recent window + tokens fed since compression
    anchor_v: torch.Tensor
    heads: list[RetainedHead]
    n_context: int  # context tokens the layer held before compression
    k_bits: int
    v_bits: int
    anchors0: int = 0  # anchor tokens at compression (the rest were fed since)
    expanded: list[float] = field(default_factory=list)  # unused: nothing is read back
    reads: list[int] = field(default_factory=list)
    full_at: list[int] = field(default_factory=list)
    parts: list[tuple[int, int]] = field(default_factory=list)  # per pass: (floating elements, code bytes) read
    _dq: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # padded K, V, mask (speed, not counted)

    @property
    def token_bytes(self) -> int:
        return 2 * self.anchor_k.shape[1] * self.anchor_k.shape[3] * self.anchor_k.element_size()

    def _tensors(self) -> list[torch.Tensor]:
        out = [self.anchor_k, self.anchor_v]
        for hd in self.heads:
            out += [x for c, lo, hi in hd.q_k for x in (c.codes, lo, hi)]
            if hd.q_v is not None:
                out += [hd.q_v.codes, hd.q_v.lo, hd.q_v.hi]
            out += [x for x in (hd.raw_k, hd.raw_v) if x is not None]
        return out

    def kept_bytes(self) -> int:
        return sum(t.nbytes for t in self._tensors()[2:])

    def pass_reads(self, element_size: int) -> list[int]:
        """Bytes each pass read with floating tensors of ``element_size`` (codes as they are)."""
        return [f * element_size + c for f, c in self.parts]

    def fast_nbytes(self) -> int:
        return self.kept_bytes() + self.anchor_k.nbytes + self.anchor_v.nbytes

    def working_nbytes(self) -> int:
        return 0

    def slow_nbytes(self) -> int:
        return 0

    def full_nbytes(self) -> int:
        return (self.n_context + self.anchor_k.shape[2] - self.anchors0) * self.token_bytes

    def append(self, keys: torch.Tensor, values: torch.Tensor, *_: Any) -> None:
        self.anchor_k = torch.cat([self.anchor_k, keys], 2)
        self.anchor_v = torch.cat([self.anchor_v, values], 2)

    def _kept(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The kept tokens dequantized, padded to the longest head: K, V (H, N, D) and the padding mask (H, N)."""
        if self._dq is None:
            h, d = self.anchor_k.shape[1], self.anchor_k.shape[3]
            n = max((hd.n for hd in self.heads), default=0)
            k = torch.zeros(h, n, d, dtype=dtype)
            v = torch.zeros(h, n, d, dtype=dtype)
            pad = torch.ones(h, n, dtype=torch.bool)
            for i, hd in enumerate(self.heads):
                if not hd.n:
                    continue
                if hd.raw_k is not None:
                    k[i, :hd.n], v[i, :hd.n] = hd.raw_k.to(dtype), hd.raw_v.to(dtype)
                else:
                    assert hd.q_v is not None
                    k[i, :hd.n] = torch.cat([c.dequantize(lo[None], hi[None], dtype)[0] for c, lo, hi in hd.q_k])
                    v[i, :hd.n] = hd.q_v.reconstruct(dtype)[0]
                pad[i, :hd.n] = False
            self._dq = (k, v, pad)
        return self._dq

    def attend(self, query: torch.Tensor, scaling: float, *_: Any) -> torch.Tensor:
        hq, tq, d = query.shape[1:]
        qg, first = _anchor_logits(query, self.anchor_k, scaling)  # (H, g*Tq, D), (H, g*Tq, A)
        k, v, pad = self._kept(query.dtype)
        kept = (qg @ k.transpose(-1, -2) * scaling).masked_fill(pad[:, None, :], float("-inf"))
        held = self._tensors()
        floats = sum(t.numel() for t in held if t.is_floating_point())
        self.parts.append((floats, sum(t.nbytes for t in held if not t.is_floating_point())))
        self.reads.append(self.fast_nbytes())
        self.full_at.append(self.full_nbytes())
        p = torch.softmax(torch.cat([kept, first], -1).float(), -1).to(query.dtype)
        return (p @ torch.cat([v, self.anchor_v[0]], 1)).reshape(1, hq, tq, d)


def _head(k: torch.Tensor, v: torch.Tensor, k_bits: int, v_bits: int) -> RetainedHead:
    """One head's kept keys / values (n, D), in position order, stored at ``k_bits`` / ``v_bits``."""
    n = k.shape[0]
    if n == 0:  # the ranking kept nothing of this head: its anchors alone
        return RetainedHead([], None, None, None, 0)
    if k_bits >= 16:
        return RetainedHead([], None, k.contiguous(), v.contiguous(), n)
    q_k = []
    for a in range(0, n, GROUP):
        kg = k[None, a:a + GROUP]  # (1, g, D)
        lo, hi = key_bounds(kg)
        q_k.append((quantize_keys(kg, lo, hi, k_bits), lo[0].contiguous(), hi[0].contiguous()))
    return RetainedHead(q_k, quantize_values(v[None], v_bits), None, None, n)


def allocate(scores: list[torch.Tensor], free: list[torch.Tensor], cap: int, d: int, k_bits: int, v_bits: int,
             element_size: int) -> list[torch.Tensor]:
    """Per layer, a (H, T) mask of the tokens kept: the highest scores over every layer and head among the ``free``
    (non-anchor) positions, the most whose exact bytes (:func:`kept_nbytes` per head) fit ``cap``."""
    flat = torch.cat([s.masked_fill(~f, float("-inf")).flatten() for s, f in zip(scores, free, strict=True)])
    order = flat.argsort(descending=True)
    n_free = int(sum(int(f.sum()) for f in free))
    shape = [s.shape for s in scores]
    sizes = [math.prod(s) for s in shape]

    def masks(n: int) -> list[torch.Tensor]:
        take = torch.zeros(flat.numel(), dtype=torch.bool)
        take[order[:n]] = True
        return [m.view(s) for m, s in zip(take.split(sizes), shape, strict=True)]

    def used(n: int) -> int:
        return sum(kept_nbytes(int(c), d, k_bits, v_bits, element_size) for m in masks(n) for c in m.sum(1).tolist())

    # bytes grow with n: the largest n that fits, by bisection below the count no group range could exceed
    floor = 2 * d * element_size if k_bits >= 16 else -(-d * k_bits // 8) + -(-d * v_bits // 8) + 2 * element_size
    lo, hi = 0, min(n_free, cap // floor)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if used(mid) <= cap else (lo, mid - 1)
    return masks(lo)


@dataclass(frozen=True)
class RetentionConfig:
    """What :func:`retain` keeps: ``memory`` x the context's bf16 K/V, kept tokens at ``bits`` (keys) /
    ``value_bits`` (values; None: ``bits``; 16: raw), ``sinks`` first and ``recent`` last tokens exact."""

    memory: float = 0.0625
    bits: int = 4
    value_bits: int | None = None
    sinks: int = 4
    recent: int = 16
    chunk: int = CHUNK  # reconstruction queries per forward call (speed only)

    def __post_init__(self) -> None:
        if not 0 < self.memory <= 1:
            raise KVStateError(f"RetentionConfig: memory={self.memory!r} must be in (0, 1] (of the bf16 context K/V)")
        for name, b in (("bits", self.bits), ("value_bits", self.v_bits)):
            if b not in (2, 4, 8, 16):
                raise KVStateError(f"RetentionConfig: {name}={b!r}; choose 2, 4, 8 or 16")
        if (self.bits >= 16) != (self.v_bits >= 16):
            raise KVStateError("RetentionConfig: 16 bits keeps raw K/V for keys and values together; set both to 16")
        if self.sinks < 0 or self.recent < 0 or self.chunk < 1:
            raise KVStateError(f"RetentionConfig: sinks={self.sinks}, recent={self.recent} must be >= 0 and "
                               f"chunk={self.chunk} >= 1")

    @property
    def v_bits(self) -> int:
        return self.bits if self.value_bits is None else self.value_bits


class RetainedCache(SemanticCache):
    """A :class:`~kvstate.semantic.SemanticCache` whose attention layers each hold a :class:`RetainedStore` once
    :meth:`compress` has run: anchors exact, the reconstruction's top tokens at the configured bits, within
    ``retention.memory`` x the bf16 K/V of the context. Decode inside :func:`~kvstate.semantic.semantic_attention`."""

    def __init__(self, model: Any, retention: RetentionConfig | None = None) -> None:
        self.retention = retention if retention is not None else RetentionConfig()
        if not isinstance(self.retention, RetentionConfig):
            raise KVStateError(f"RetainedCache: retention must be a RetentionConfig, got {type(retention).__name__}")
        r = self.retention
        super().__init__(model, None, SemanticConfig(budget=r.memory, segment=SegmentConfig(sinks=r.sinks,
                                                                                              recent=r.recent),
                                                     zoom="none", slow_tier=False))
        self.bits = r.bits

    def compress(self, scores: Any = None) -> None:
        """Keep, per layer and KV head, the highest-``scores`` tokens (layer -> (H, T), e.g.
        :func:`reconstruction_scores`) that fit the memory, and drop the rest."""
        layers = self.semantic_layers
        if not isinstance(scores, dict) or any(layer.layer_idx not in scores for layer in layers):
            raise KVStateError("RetainedCache.compress: pass the per-layer token scores (layer index -> (heads, "
                               "tokens)); reconstruction_scores(model, tokenizer, cache, context) computes them")
        if any(layer.store is not None for layer in layers):
            raise KVStateError("RetainedCache.compress: this cache is already compressed; compress once per context")
        k0 = layers[0].keys
        if k0 is None or not k0.numel():
            raise KVStateError("RetainedCache.compress: the cache holds no context; prefill it first")
        t, h, d = k0.shape[2], k0.shape[1], k0.shape[3]
        r = self.retention
        anchor = torch.zeros(t, dtype=torch.bool)
        anchor[:min(r.sinks, t)] = True
        anchor[max(0, t - r.recent):] = True
        a = int(anchor.sum())
        full = len(layers) * t * 2 * h * d * FLOAT_BYTES
        cap = int(r.memory * full) - len(layers) * a * 2 * h * d * FLOAT_BYTES
        if cap < 0:
            raise BudgetError(f"budget {r.memory} of the bf16 context K/V ({full} bytes) cannot hold the "
                              f"{a} exact anchor tokens: budget >= {a / t:.4f}; raise the budget or lower sinks / recent")
        got = [scores[layer.layer_idx].float() for layer in layers]
        if any(s.shape != (h, t) for s in got):
            raise KVStateError(f"RetainedCache.compress: scores must be ({h}, {t}) per layer (heads, context tokens), "
                               f"got {sorted({tuple(s.shape) for s in got})}")
        masks = allocate(got, [(~anchor)[None].expand(h, t) for _ in layers], cap, d, r.bits, r.v_bits, FLOAT_BYTES)
        for layer, m in zip(layers, masks, strict=True):
            k, v = layer.keys[0], layer.values[0]  # (H, T, D)
            heads = [_head(k[i, m[i]], v[i, m[i]], r.bits, r.v_bits) for i in range(h)]
            layer.store = RetainedStore(layer.keys[:, :, anchor].contiguous(), layer.values[:, :, anchor].contiguous(),
                                        heads, t, r.bits, r.v_bits, a)
            layer.keys = layer.values = None


@torch.no_grad()
def retain(model: Any, tokenizer: Any, input_ids: torch.Tensor, config: RetentionConfig | None = None) -> RetainedCache:
    """Prefill ``input_ids`` (1, T) — the context — score it by reconstruction and keep what ``config`` holds."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise KVStateError(f"retain: input_ids must be a (1, T) tensor of the context, got "
                           f"{getattr(input_ids, 'shape', type(input_ids).__name__)}")
    cache = RetainedCache(model, config)
    model(input_ids=input_ids, position_ids=torch.arange(input_ids.shape[1])[None], cache=cache, use_cache=True)
    cache.compress(reconstruction_scores(model, tokenizer, cache, input_ids[0].tolist(), cache.retention.chunk))
    return cache


__all__ = ["RetainedCache", "RetainedHead", "RetainedStore", "RetentionConfig", "allocate", "kept_nbytes",
           "reconstruction_scores", "retain"]
