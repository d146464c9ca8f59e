"""``SparsePrefixCache``: sparse prefix caching for hybrid / recurrent HF models, served one request at a time.

"Sparse Prefix Caching for Hybrid and Recurrent LLM Serving" keeps dense attention KV and recurrent
states at sparse, planned positions. This engine drives the radix store (``store.py``) with one
transaction per request: ``begin`` (match, record the true overlap, pin, plan, say what to capture),
a forward pass over the suffix only whose calls end at the positions to capture (no second prefill),
then ``commit`` (insert the suffix's KV once into the tree, the captured states and the logits, evict
unpinned leaves under the byte budget) — or ``abort`` if the forward pass failed. Output equals the
same segmented computation bit for bit.

Batch of one: each call serves one unpadded sequence. The store verbs run under one lock; forward
passes run outside it, so requests on several threads overlap (what they use is pinned).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvstate.errors import BudgetError, KVStateError
from kvstate.models import (
    LayerKind,
    ResumableCache,
    checkpoint_bytes,
    chunk_size,
    kv_bytes_per_token,
    layer_kinds,
    segmented_prefill,
    snapshot_cache,
)
from kvstate.prefix.config import PrefixCacheConfig
from kvstate.prefix.eviction import Policy
from kvstate.prefix.placement import plan_checkpoints
from kvstate.prefix.segments import build_cache, kv_segment, split_segment, to_device
from kvstate.prefix.store import Hit, PrefixStore, StoreConfig, StoreMetrics, Txn


@dataclass
class PrefillResult:
    logits: torch.Tensor  # (1, V) logits of the last position
    cache: ResumableCache  # the first T-1 tokens: model.generate(input_ids, cache=..., attention_mask=...) feeds the last one
    reused_tokens: int  # tokens restored from the store
    recomputed_tokens: int  # tokens run through the model
    new_tokens: int  # tokens the store did not hold at all
    lost_tokens: int  # tokens the KV covered but no checkpoint did (recomputed because of sparsity)
    attention_mask: (
        torch.Tensor
    )  # (1, T) all ones: pass it to generate so its positions agree with the cache's


def held_nbytes(payload: Any) -> int:
    """Bytes a stored payload holds, in its real dtype: a recurrent state (``CacheSnapshot``) or a logits row."""
    if isinstance(payload, torch.Tensor):
        return payload.numel() * payload.element_size()
    return int(payload.nbytes)


class SparsePrefixCache:
    """A prefix cache for one model under one byte budget. Thread-safe; batch of one per call."""

    def __init__(
        self,
        model: Any,
        budget_bytes: int | PrefixCacheConfig,
        slots_per_entry: int = 8,
        planner: str = "optimal",
        align: int | None = None,
        *,
        policy: str = "lru",
        alpha: float = 1.0,
        block_size: int = 64,
        state_device: str | None = None,
        placement: str = "path",
    ) -> None:
        cfg = (
            budget_bytes
            if isinstance(budget_bytes, PrefixCacheConfig)
            else PrefixCacheConfig(
                budget_bytes, slots_per_entry, planner, align, policy, alpha, block_size, state_device, placement
            )
        )
        self.config = cfg
        self.model = model
        self._kinds = layer_kinds(model.config)  # raises for unsupported families
        dtype = next(model.parameters()).dtype
        self._device = next(model.parameters()).device
        self.align = int(cfg.align if cfg.align is not None else (chunk_size(model.config) or 1))
        has_rec = any(k in (LayerKind.RECURRENT, LayerKind.HYBRID) for k in self._kinds)
        has_attn = any(k in (LayerKind.ATTENTION, LayerKind.HYBRID) for k in self._kinds)
        n_params = sum(p.numel() for p in model.parameters())
        vocab = int(model.get_output_embeddings().weight.shape[0])
        self.store = PrefixStore(
            StoreConfig(
                budget_bytes=cfg.budget_bytes,
                slots_per_entry=cfg.slots_per_entry,
                checkpoint_bytes=checkpoint_bytes(model.config, dtype) if has_rec else 0,
                kv_bytes_per_token=kv_bytes_per_token(model.config, dtype) if has_attn else 0,
                logits_bytes=vocab * dtype.itemsize,
                has_recurrent=has_rec,
                has_attention=has_attn,
                policy=Policy(cfg.policy),
                alpha=cfg.alpha,
                flops_per_token=2.0 * n_params,
                placement=cfg.placement,
                align=self.align,
            ),
            planner=self._plan,
            splitter=split_segment,
            sizer=held_nbytes,
        )
        self._lock = threading.Lock()

    # -- metrics (immutable snapshots; safe from any thread) -------------------------------------
    @property
    def metrics(self) -> StoreMetrics:
        with self._lock:
            return self.store.metrics()

    def reset_metrics(self) -> None:
        with self._lock:
            self.store.reset_metrics()

    def bytes_by_kind(self) -> dict[str, int]:
        with self._lock:
            return self.store.bytes_by_kind()

    # -- planning -----------------------------------------------------------------------------------
    def _plan(self, weights: np.ndarray, n: int) -> list[int]:
        if n <= self.align:
            return []
        c = self.config
        return plan_checkpoints(weights, c.slots_per_entry, c.planner, self.align, block_size=c.block_size)

    # -- serving ------------------------------------------------------------------------------------
    def _tokens(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, tuple[int, ...]]:
        if input_ids.dim() == 1:
            input_ids = input_ids.unsqueeze(0)
        if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] == 0:
            raise KVStateError(
                f"input_ids must be one non-empty sequence (1, T); got shape {tuple(input_ids.shape)}."
            )
        if attention_mask is not None and (
            tuple(attention_mask.shape) != tuple(input_ids.shape) or not bool((attention_mask == 1).all())
        ):
            raise KVStateError(
                f"attention_mask must be all ones with the shape of input_ids {tuple(input_ids.shape)}; got shape "
                f"{tuple(attention_mask.shape)} with {int((attention_mask == 0).sum())} zeros. The prefix cache serves "
                "one unpadded sequence: strip the padding before calling prefill."
            )
        return input_ids, tuple(int(t) for t in input_ids[0].tolist())

    def _restore(self, txn: Txn, length: int) -> ResumableCache:
        return build_cache(self.model.config, self._kinds, list(txn.kv), txn.state, length, self._device)

    @torch.no_grad()
    def prefill(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        boundaries: Sequence[int] | None = None,
    ) -> PrefillResult:
        """Serve one prompt. ``attention_mask`` may be given but must be all ones (a batch of one, no padding):
        the cache is built with positions ``0..T-1``, which is what ``generate`` uses for an all-ones mask.

        ``boundaries``: positions (strictly increasing, in ``1..T``) where later requests are expected to
        part from this one — the end of a document or of each chat message (:func:`chat_boundaries`). The
        state there is captured in this same pass while it pays off (it competes with the planned positions
        for ``slots_per_entry``; ``docs/techniques.md#position``), so the next request sharing the prefix up
        to a boundary resumes from it."""
        input_ids, tokens = self._tokens(input_ids, attention_mask)
        n = len(tokens)
        ones = torch.ones_like(input_ids)
        with self._lock:
            txn = self.store.begin(tokens, boundaries=() if boundaries is None else boundaries)
            hit, start = txn.hit, txn.hit.position
            try:
                if hit.full:  # nothing to compute or insert: the stored logits and end state
                    logits = txn.logits.to(self._device, copy=True)
                    served = PrefillResult(logits, self._restore(txn, n - 1), n, 0, 0, 0, ones)
                    self.store.commit(txn, {}, None)  # learns from the request and counts it
                    return served
                cache: ResumableCache | None = self._restore(txn, start) if start else None
            except BaseException:
                self.store.abort(txn)  # a no-op once committed
                raise
        try:
            rec = self.store.config.has_recurrent
            cuts = sorted(set(txn.capture) | ({n - 1} if rec and n - 1 > start else set()))
            out = segmented_prefill(
                self.model, input_ids, cuts=cuts, cache=cache, start=start, capture="recurrent"
            )
            dev = self.config.state_device
            states = {p: to_device(out.snapshots[p], dev) for p in txn.capture}
            result_cache: ResumableCache
            if rec and n - 1 > start:
                result_cache = build_cache(
                    self.model.config,
                    self._kinds,
                    [],
                    out.snapshots[n - 1],
                    n - 1,
                    self._device,
                    live=out.cache,
                )
            elif n > 1:
                result_cache = (
                    self._restore(txn, n - 1)
                    if start == n - 1
                    else build_cache(
                        self.model.config, self._kinds, [], None, n - 1, self._device, live=out.cache
                    )
                )
            else:
                result_cache = ResumableCache(self.model.config)
            live = out.cache
            kinds = self._kinds

            def kv(a: int, b: int) -> Any:
                return kv_segment(live, a, b, kinds, dev)

            logits = out.logits.to(dev) if dev is not None else out.logits.clone()
        except BaseException:
            with self._lock:
                self.store.abort(txn)
            raise
        with self._lock:
            self.store.commit(txn, states, kv if self.store.config.has_attention else None, logits)
        return PrefillResult(
            logits=out.logits,
            cache=result_cache,
            reused_tokens=start,
            recomputed_tokens=n - start,
            new_tokens=n - hit.overlap,
            lost_tokens=hit.lost,
            attention_mask=ones,
        )

    @torch.no_grad()
    def insert(self, input_ids: torch.Tensor, cache: Any, covered: int | None = None) -> bool:
        """Cache what a forward pass or ``generate`` already computed: ``cache`` holds the state after the
        first ``covered`` tokens of ``input_ids`` (default ``T-1``: what ``generate`` leaves for its output
        sequence). Returns False when it did not fit the budget (the store is then unchanged)."""
        input_ids, tokens = self._tokens(input_ids, None)
        covered = len(tokens) - 1 if covered is None else int(covered)
        if not 0 < covered <= len(tokens):
            raise KVStateError(f"covered={covered} must be in 1..{len(tokens)} (the tokens the cache holds).")
        dev = self.config.state_device
        states = {}
        if self.store.config.has_recurrent:
            states[covered] = to_device(snapshot_cache(cache, covered, self._kinds, attention=False), dev)
        if self.store.config.has_attention:
            held = cache.get_seq_length()
            if held != covered:
                raise KVStateError(
                    f"the cache holds {held} tokens of KV but covered={covered}; pass covered={held}."
                )
        kinds = self._kinds

        def kv(a: int, b: int) -> Any:
            return kv_segment(cache, a, b, kinds, dev)

        with self._lock:
            txn = self.store.begin(tokens, serving=False)
            return self.store.commit(
                txn, states, kv if self.store.config.has_attention else None, None, covered
            )

    def pin(self, input_ids: torch.Tensor) -> None:
        """Keep a prefix (a system prompt) from eviction until :meth:`unpin`; computes it if not stored."""
        input_ids, tokens = self._tokens(input_ids, None)
        sc = self.store.config
        need = len(tokens) * sc.kv_bytes_per_token + sc.checkpoint_bytes + sc.logits_bytes
        with self._lock:
            pinned = self.store.pinned_bytes()
        if pinned + need > sc.budget_bytes:
            raise BudgetError(
                f"pinning {len(tokens)} tokens needs about {need:,} bytes on top of {pinned:,} already pinned, over the "
                f"budget of {sc.budget_bytes:,}; raise budget_bytes or pin a shorter prefix."
            )
        with self._lock:
            if self.store.lookup(tokens).overlap == len(tokens):
                self.store.pin(tokens)
                return
        self.prefill(input_ids)
        with self._lock:
            self.store.pin(tokens)

    def unpin(self, input_ids: torch.Tensor) -> None:
        _, tokens = self._tokens(input_ids, None)
        with self._lock:
            self.store.unpin(tokens)

    def lookup(self, input_ids: torch.Tensor) -> Hit:
        """Where a request would resume, without computing, recording or inserting anything."""
        _, tokens = self._tokens(input_ids, None)
        with self._lock:
            return self.store.lookup(tokens)
