"""Continuous batching of the decode phase: several requests' caches as one batched cache, one token each per step.

Iteration-level scheduling as in "Orca: A Distributed Serving System for Transformer-Based Generative
Models" (Yu et al., OSDI 2022) and vLLM ("Efficient Memory Management for Large Language Model Serving
with PagedAttention", Kwon et al., SOSP 2023): a request joins the running batch as soon as its prefill is
done (:meth:`DecodeBatch.add`) and leaves it the step it finishes (:meth:`DecodeBatch.remove`), so no row
waits for the longest request of a static batch. Here the rows are also hybrid / recurrent models' rows:

- attention KV ``(1, H, T_i, D)`` is left-padded to the batch's longest length and the pads get zeros in
  the 2D attention mask ``(B, Lmax + 1)``; RoPE was applied to the keys at their own positions during
  prefill and each row is fed ``position_ids`` = its own length, so a row sees exactly what it would alone;
- conv and recurrent (Gated DeltaNet / Mamba2 SSD) states are concatenated along the batch dimension.
  They are O(1) in length, so they need no padding; in transformers 5.24 every supported family
  (Qwen3.5, Qwen3-Next, Mamba2, Bamba, Falcon-H1) derives its recurrent layers' padding mask with
  ``create_recurrent_attention_mask``, which is ``None`` for a one-token step: the pads never reach the
  conv or recurrent update. Every family in :data:`kvstate.models.FAMILIES` therefore batches exactly
  (batched == alone up to floating-point reduction order: ≤ 3e-6 in fp32 on the tests' models); any other
  model (NemotronH, sliding-window layers, ...) is refused when the batch is built (``UnsupportedModelError``).

Rows are read and rebuilt through kvstate's one state contract (:func:`snapshot_cache` /
:func:`restore_cache`), never through transformers' layer internals; after every join, leave and step the
batch measures the bytes its tensors hold (:class:`BatchBytes`: the rows' own KV, its left padding, the
recurrent states), so another thread (a ``/metrics`` scrape) reads a consistent figure without touching them. Joining or leaving copies the
batch's state a few times (snapshot, pad and stack, restore); transformers' ``DynamicLayer`` copies the
whole KV on every step anyway.

Ignores: paged KV blocks (the KV is one dense left-padded tensor per layer, so a long row pads every
other), chunked prefill mixed into decode steps (prefill runs one request at a time, outside the batch),
sliding-window and cross-layer-shared attention, speculative decoding, and preemption / swapping.
Not thread-safe: one batch is driven from one thread, like the model under it.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from kvstate.errors import BudgetError, KVStateError
from kvstate.models import (
    AttentionState,
    CacheSnapshot,
    LayerKind,
    LayerSnapshot,
    RecurrentState,
    ResumableCache,
    layer_kinds,
    restore_cache,
    snapshot_cache,
)
from kvstate.prefix.engine import TOKEN_PATH

RequestId = Hashable  # whatever the server names a request by (a string, an int)


@dataclass(frozen=True)
class BatchBytes:
    """Bytes the batch's tensors hold (numel × element size of each), measured after its last change."""

    rows: int = 0  # requests the bytes are held for
    kv: int = 0  # attention keys and values of the rows' own tokens
    padding: int = 0  # attention keys and values of the left pads (a shorter row padded to the longest)
    recurrent: int = 0  # conv and recurrent states

    @property
    def total(self) -> int:
        return self.kv + self.padding + self.recurrent


@dataclass(frozen=True)
class BatchConfig:
    max_batch: int = 8  # rows decoded together at most; add() refuses one more

    def __post_init__(self) -> None:
        if isinstance(self.max_batch, bool) or not isinstance(self.max_batch, int) or self.max_batch < 1:
            raise KVStateError(
                f"BatchConfig.max_batch must be an integer >= 1 (rows decoded together), got {self.max_batch!r}."
            )


class DecodeBatch:
    """The running decode batch of one model: rows join (:meth:`add`), step together (:meth:`step`), leave
    (:meth:`remove`), and hand their own cache back (:meth:`cache_of`)."""

    def __init__(self, model: Any, config: BatchConfig | None = None) -> None:
        self.model = model
        self.config = config if config is not None else BatchConfig()
        self._kinds = layer_kinds(model.config)  # raises UnsupportedModelError for a family kvstate cannot read
        self._has_attention = any(k in (LayerKind.ATTENTION, LayerKind.HYBRID) for k in self._kinds)
        self._device = next(model.parameters()).device
        self._vocab = int(model.get_output_embeddings().weight.shape[0])
        self._rows: list[RequestId] = []  # row order of the batched cache
        self._lengths: list[int] = []  # tokens each row's state covers (its next position)
        self._origins: list[str | None] = []  # the model fingerprint each row's cache carried in
        self._paths: list[tuple[int, str] | None] = []  # the token path each row's cache carried in
        self._cache: DynamicCache | None = None  # None while the batch is empty
        self._mask = torch.zeros((0, 0), dtype=torch.long, device=self._device)  # (B, Lmax): 0 on left pads
        self._broken: str | None = None  # why the batched state was lost (a forward that raised)
        self.held = BatchBytes()  # replaced whole after every change: safe to read from another thread
        self.peak_bytes = 0  # the most bytes held at once (BatchBytes.total)

    # -- inspection ---------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, rid: object) -> bool:
        return rid in self._rows

    @property
    def rids(self) -> tuple[RequestId, ...]:
        """The requests in the batch, in row order."""
        return tuple(self._rows)

    @property
    def padded_length(self) -> int:
        """The batched KV length, left padding included (the longest row's length; 0 without attention
        layers): what every attention layer of every row holds, the padding waste's measure."""
        return int(self._mask.shape[1])

    def length(self, rid: RequestId) -> int:
        """Tokens the row's state covers: the position its next token is fed at."""
        return self._lengths[self._index(rid)]

    # -- verbs --------------------------------------------------------------------------------------
    def add(self, rid: RequestId, cache: DynamicCache, length: int) -> None:
        """Join ``cache`` (a batch of one holding exactly ``length`` tokens: a prefill's ``full_state`` cache)
        to the batch as a new row. The row's state is copied: ``cache`` is left as it was."""
        self._check_usable()
        if rid in self._rows:
            raise KVStateError(f"add: request {rid!r} is already in the batch; remove it first or use a new id.")
        if len(self._rows) >= self.config.max_batch:
            raise BudgetError(
                f"add: the batch is full ({self.config.max_batch} rows, BatchConfig.max_batch); "
                "wait for a row to finish (remove) or raise max_batch."
            )
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise KVStateError(f"add: length must be an integer >= 1 (tokens the cache holds), got {length!r}.")
        if not isinstance(cache, DynamicCache):
            raise KVStateError(
                "add: cache must be a DynamicCache(config=model.config) (e.g. prefill(..., full_state=True).cache), "
                f"got {type(cache).__name__}."
            )
        row = snapshot_cache(cache, length, self._kinds, clone=False)  # checks the layer count and KV length; copied below
        if not self._has_attention and isinstance(cache, ResumableCache):
            # no KV to count: a sealed recurrent cache still knows its length until it is advanced
            try:
                held: int | None = cache.covered_tokens
            except KVStateError:
                held = None  # advanced since it was sealed: its length is the caller's word
            if held is not None and held != length:
                raise KVStateError(
                    f"add: request {rid!r}'s cache holds the state after {held} tokens, not {length}; pass length={held}."
                )
        current = None if self._cache is None else self._snapshot()
        self._check_row(rid, row, current)
        self._install([row] if current is None else [current, row], [*self._lengths, length])
        self._rows.append(rid)
        self._lengths.append(length)
        self._origins.append(getattr(cache, "origin", None))
        self._paths.append(getattr(cache, TOKEN_PATH, None))
        self._measure()

    def remove(self, rid: RequestId) -> None:
        """The row leaves the batch now; left padding that no remaining row needs is trimmed. Removing the
        last row empties the batch (and makes a batch whose step failed usable again)."""
        i = self._index(rid)
        keep = [j for j in range(len(self._rows)) if j != i]
        lengths = [self._lengths[j] for j in keep]
        if not keep:
            self._cache, self._broken = None, None
            self._mask = self._mask[:0, :0]
        elif self._broken is None:
            self._install([_select(self._snapshot(), keep)], lengths)
        del self._rows[i], self._origins[i], self._paths[i]
        self._lengths = lengths
        self._measure()

    @torch.no_grad()
    def step(self, tokens: Mapping[RequestId, int]) -> dict[RequestId, torch.Tensor]:
        """Feed each row its next token (one forward call for the whole batch); each row's logits ``(V,)``.

        ``tokens`` must name every row exactly once: a recurrent state cannot skip a step, and a placeholder
        token would advance it for good."""
        self._check_usable()
        if not self._rows:
            raise KVStateError("step: the batch is empty; add a request's cache first.")
        if set(tokens) != set(self._rows):
            missing = [r for r in self._rows if r not in tokens]
            extra = [r for r in tokens if r not in self._rows]
            raise KVStateError(
                f"step: tokens must name every row of the batch once; missing {missing}, not in the batch {extra}. "
                "Remove finished requests before stepping."
            )
        ids = []
        for rid in self._rows:
            t = tokens[rid]
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self._vocab:
                raise KVStateError(
                    f"step: token {t!r} for request {rid!r} is not a token id in 0..{self._vocab - 1}; "
                    "feed the id the sampler returned."
                )
            ids.append([t])
        x = torch.tensor(ids, dtype=torch.long, device=self._device)  # (B, 1)
        positions = torch.tensor(self._lengths, dtype=torch.long, device=self._device).unsqueeze(1)  # (B, 1)
        mask = None
        if self._has_attention:
            ones = torch.ones((len(self._rows), 1), dtype=torch.long, device=self._device)  # (B, 1)
            mask = torch.cat([self._mask, ones], dim=1)  # (B, Lmax + 1)
        try:
            out = self.model(
                input_ids=x, position_ids=positions, attention_mask=mask, cache=self._cache,
                use_cache=True, logits_to_keep=1,
            )
        except BaseException as exc:
            # some layers may have advanced already (states update in place): no row can be trusted now
            self._broken = f"a step failed ({type(exc).__name__}: {exc})"
            raise
        logits: torch.Tensor = out.logits[:, -1]  # (B, V)
        if mask is not None:
            self._mask = mask
        self._lengths = [n + 1 for n in self._lengths]
        self._measure()
        return {rid: logits[i] for i, rid in enumerate(self._rows)}  # each (V,)

    def cache_of(self, rid: RequestId) -> ResumableCache:
        """The row's own batch-of-one cache (unpadded KV, its recurrent state): a copy sealed at its length and
        tagged with the model fingerprint its cache came in with — what ``SparsePrefixCache.insert`` takes."""
        self._check_usable()
        i = self._index(rid)
        n = self._lengths[i]
        row = _select(self._snapshot(), [i])
        cache = restore_cache(self.model.config, _last(row, n), n)
        cache.origin = self._origins[i]
        if self._paths[i] is not None:
            setattr(cache, TOKEN_PATH, self._paths[i])
        return cache

    # -- internals ----------------------------------------------------------------------------------
    def _index(self, rid: RequestId) -> int:
        try:
            return self._rows.index(rid)
        except ValueError:
            raise KVStateError(f"request {rid!r} is not in the batch (rows: {list(self._rows)}).") from None

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise KVStateError(
                f"the batch's state was lost: {self._broken}. Remove its rows and prefill those requests again."
            )

    def _lmax(self) -> int:
        return max(self._lengths) if self._lengths else 0

    def _snapshot(self) -> CacheSnapshot:
        """The batched cache's state as views, ``length`` = the padded KV length: every caller copies what it
        keeps (stacking, selecting rows, restoring), so cloning here would only add a copy of the batch."""
        assert self._cache is not None and self._rows, "snapshot of an empty batch"
        lmax = self._lmax() if self._has_attention else 0
        return snapshot_cache(self._cache, lmax, self._kinds, clone=False)

    def _measure(self) -> None:
        """Set :attr:`held` from the tensors the batch holds now (views: nothing is copied)."""
        if self._cache is None or not self._rows:
            self.held = BatchBytes()
            return
        if self._broken is not None:  # the state is unusable; it is freed when the last row leaves
            return
        snap = self._snapshot()
        kv = snap.attention_nbytes
        slots = len(self._rows) * snap.length  # positions each attention layer holds, pads included
        padding = kv * (slots - sum(self._lengths)) // slots if self._has_attention and slots else 0
        self.held = BatchBytes(len(self._rows), kv - padding, padding, snap.recurrent_nbytes)
        self.peak_bytes = max(self.peak_bytes, self.held.total)

    def _check_row(self, rid: RequestId, row: CacheSnapshot, current: CacheSnapshot | None) -> None:
        """One row of this model's shapes and dtypes, on its device, like the rows already in the batch."""
        want = {} if current is None else _layout(current)
        for key, got in _layout(row).items():
            i, name = key
            if got[0][0] != 1:
                raise KVStateError(
                    f"add: request {rid!r}'s cache layer {i} {name} has batch size {got[0][0]}; "
                    "add batch-of-one caches (one request each)."
                )
            if got[2] != self._device:
                raise KVStateError(
                    f"add: request {rid!r}'s cache layer {i} {name} is on {got[2]}, the model on {self._device}; "
                    "move the cache to the model's device."
                )
            if key in want and want[key][1:] != got[1:]:
                raise KVStateError(
                    f"add: request {rid!r}'s cache layer {i} {name} is {got[1]}, the batch's rows hold {want[key][1]}; "
                    "add caches filled the same way (prefill's full_state cache) by this model."
                )

    def _install(self, parts: list[CacheSnapshot], lengths: list[int]) -> None:
        """Install the batched cache made of ``parts`` stacked along the batch, left-padded (or trimmed on the
        left) to the longest row; the 2D mask marks each row's pads."""
        lmax = max(lengths) if self._has_attention else 0
        self._cache = restore_cache(self.model.config, _concat(parts, lmax), lmax, copy=False)  # _concat's are fresh
        pos = torch.arange(lmax, device=self._device)  # (Lmax,)
        pads = torch.tensor([lmax - n for n in lengths], device=self._device).unsqueeze(1)  # (B, 1)
        self._mask = (pos.unsqueeze(0) >= pads).long()  # (B, Lmax); (B, 0) without attention layers


def _layout(snap: CacheSnapshot) -> dict[tuple[int, str], tuple[tuple[int, ...], tuple[Any, ...], torch.device]]:
    """Per (layer, tensor): its full shape, (shape without batch and length, dtype), and its device."""
    out = {}
    for i, layer in enumerate(snap.layers):
        named: list[tuple[str, torch.Tensor, bool]] = []
        if layer.attention is not None:
            named += [("keys", layer.attention.keys, True), ("values", layer.attention.values, True)]
        if layer.recurrent is not None:
            named += [("conv state", layer.recurrent.conv, False), ("recurrent state", layer.recurrent.recurrent, False)]
        for name, t, is_kv in named:
            inner = (t.shape[1], t.shape[3]) if is_kv else tuple(t.shape[1:])  # KV length differs per row
            out[(i, name)] = (tuple(t.shape), (inner, t.dtype), t.device)
    return out


def _map(snap: CacheSnapshot, length: int, kv: Any, rec: Any) -> CacheSnapshot:
    """``snap`` with ``kv`` applied to every keys/values tensor and ``rec`` to every conv/recurrent state."""
    layers = tuple(
        LayerSnapshot(
            layer.kind,
            None if layer.attention is None else AttentionState(kv(layer.attention.keys), kv(layer.attention.values)),
            None if layer.recurrent is None else RecurrentState(rec(layer.recurrent.conv), rec(layer.recurrent.recurrent)),
        )
        for layer in snap.layers
    )
    return CacheSnapshot(length, layers)


def _select(snap: CacheSnapshot, rows: list[int]) -> CacheSnapshot:
    """The given batch rows of a snapshot (views; still padded to ``snap.length``)."""
    def pick(t: torch.Tensor) -> torch.Tensor:
        return t[rows[0] : rows[0] + 1] if len(rows) == 1 else t.index_select(0, torch.tensor(rows, device=t.device))

    return _map(snap, snap.length, pick, pick)


def _last(snap: CacheSnapshot, n: int) -> CacheSnapshot:
    """A left-padded snapshot cut to its last ``n`` positions (one row: its own, unpadded KV)."""
    return _map(snap, n, lambda t: t[..., t.shape[-2] - n :, :], lambda t: t)


def _pad_left(t: torch.Tensor, total: int) -> torch.Tensor:
    """Keys or values ``(b, H, T, D)`` → ``(b, H, total, D)``: the last ``min(T, total)`` positions, zeros before."""
    keep = t[..., t.shape[-2] - min(total, t.shape[-2]) :, :]  # (b, H, <= total, D): pads no row needs trimmed
    pad = total - keep.shape[-2]
    if pad == 0:
        return keep
    zeros = keep.new_zeros((*keep.shape[:-2], pad, keep.shape[-1]))  # (b, H, pad, D)
    return torch.cat([zeros, keep], dim=-2)  # (b, H, total, D)


def _concat(parts: list[CacheSnapshot], total: int) -> CacheSnapshot:
    """Stack snapshots along the batch dimension, attention KV left-padded (or trimmed on the left) to ``total``."""
    layers = []
    for i, first in enumerate(parts[0].layers):
        att = rec = None
        if first.attention is not None:
            kv = [p.layers[i].attention for p in parts]
            keys = torch.cat([_pad_left(a.keys, total) for a in kv if a is not None], dim=0)  # (B, H, total, D)
            values = torch.cat([_pad_left(a.values, total) for a in kv if a is not None], dim=0)  # (B, H, total, D)
            att = AttentionState(keys, values)
        if first.recurrent is not None:
            rs = [p.layers[i].recurrent for p in parts]
            conv = torch.cat([r.conv for r in rs if r is not None], dim=0)  # (B, C, K)
            state = torch.cat([r.recurrent for r in rs if r is not None], dim=0)  # (B, heads, a, b)
            rec = RecurrentState(conv, state)
        layers.append(LayerSnapshot(first.kind, att, rec))
    return CacheSnapshot(total, tuple(layers))
