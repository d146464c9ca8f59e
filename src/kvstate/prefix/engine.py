"""``SparsePrefixCache``: sparse prefix caching for hybrid / recurrent HF models (seed 000), end to end.

On ``prefill(input_ids)``: find the cached entry that lets the request resume deepest (dense attention
KV sliced to the deepest recurrent checkpoint ≤ the overlap), restore it into a fresh transformers
``DynamicCache``, compute only the suffix, capturing recurrent checkpoints *in the same pass* (forward
calls end at the planned, chunk-aligned positions — no second prefill as in the paper's code), then
admit the request as an entry. Output equals the same segmented computation bit for bit.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvstate.errors import KVStateError
from kvstate.models import (
    LayerKind,
    ResumableCache,
    checkpoint_bytes,
    chunk_size,
    kv_bytes_per_token,
    layer_kinds,
    restore_cache,
    segmented_prefill,
    snapshot_cache,
)
from kvstate.prefix.eviction import Policy
from kvstate.prefix.histogram import OverlapHistogram
from kvstate.prefix.placement import METHODS, plan_checkpoints
from kvstate.prefix.store import Entry, Hit, PrefixStore, StoreConfig


@dataclass
class PrefillResult:
    logits: torch.Tensor  # (1, V) logits of the last position
    cache: ResumableCache  # the first T-1 tokens: model.generate(input_ids, cache=..., attention_mask=...) feeds the last one
    reused_tokens: int  # tokens restored from the store
    recomputed_tokens: int  # tokens run through the model
    new_tokens: int  # tokens no cached entry shared
    lost_tokens: int  # tokens the KV covered but no checkpoint did (recomputed because of sparsity)
    attention_mask: (
        torch.Tensor
    )  # (1, T) all ones: pass it to generate so its positions agree with the cache's


class SparsePrefixCache:
    """A prefix cache for one model under one byte budget. Thread-safe (one lock around prefill)."""

    def __init__(
        self,
        model: Any,
        budget_bytes: int,
        slots_per_entry: int = 8,
        planner: str = "optimal",
        align: int | None = None,
        *,
        policy: str = "lru",
        alpha: float = 1.0,
        drift_threshold: float = 0.2,
        gamma: float = 0.98,
        block_size: int = 64,
    ) -> None:
        if planner not in METHODS:
            raise KVStateError(f"planner={planner!r} is not one of {sorted(METHODS)}.")
        if policy not in {p.value for p in Policy}:
            raise KVStateError(f"policy={policy!r} is not one of {[p.value for p in Policy]}.")
        self.model = model
        self.config = model.config
        self._kinds = layer_kinds(self.config)  # raises for unsupported families
        dtype = next(model.parameters()).dtype
        self.align = int(align if align is not None else (chunk_size(self.config) or 1))
        if self.align < 1:
            raise KVStateError(f"align={align} must be >= 1 (default: the model's chunk size).")
        self.planner = planner
        self.slots_per_entry = slots_per_entry
        self.block_size = block_size
        has_rec = any(k in (LayerKind.RECURRENT, LayerKind.HYBRID) for k in self._kinds)
        has_attn = any(k in (LayerKind.ATTENTION, LayerKind.HYBRID) for k in self._kinds)
        n_params = sum(p.numel() for p in model.parameters())
        self.store = PrefixStore(
            StoreConfig(
                budget_bytes=budget_bytes,
                slots_per_entry=slots_per_entry,
                checkpoint_bytes=checkpoint_bytes(self.config, dtype) if has_rec else 0,
                kv_bytes_per_token=kv_bytes_per_token(self.config, dtype) if has_attn else 0,
                has_recurrent=has_rec,
                has_attention=has_attn,
                policy=Policy(policy),
                alpha=alpha,
                flops_per_token=2.0 * n_params,
                drift_threshold=drift_threshold,
                gamma=gamma,
            ),
            planner=self._plan,
        )
        self._prior = OverlapHistogram(1, gamma=gamma)  # store-wide overlap depths: plans new entries
        self._lock = threading.Lock()

    @property
    def metrics(self):  # type: ignore[no-untyped-def]
        return self.store.metrics

    def _plan(self, weights: np.ndarray, n: int) -> list[int]:
        if n <= self.align:
            return []
        return plan_checkpoints(
            weights, self.slots_per_entry, self.planner, self.align, block_size=self.block_size
        )

    def _restore(self, kv: Any, recurrent: Any, position: int) -> ResumableCache:
        if position == 0:
            return ResumableCache(self.config)
        return restore_cache(
            self.config, kv if kv is not None else recurrent, length=position, recurrent=recurrent
        )

    def _restore_entry(self, e: Entry, position: int) -> ResumableCache:
        recurrent = None
        if self.store.config.has_recurrent:
            recurrent = e.final if position == e.length - 1 else e.checkpoints[position]
        return self._restore(e.kv, recurrent, position)

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> PrefillResult:
        """Serve one prompt. ``attention_mask`` may be given but must be all ones (a batch of one, no padding):
        the cache is built with positions ``0..T-1``, which is what ``generate`` uses for an all-ones mask."""
        if input_ids.dim() == 1:
            input_ids = input_ids.unsqueeze(0)
        if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] == 0:
            raise KVStateError(
                f"input_ids must be one non-empty sequence (1, T); got shape {tuple(input_ids.shape)}."
            )
        ones = torch.ones_like(input_ids)
        if attention_mask is not None and (
            tuple(attention_mask.shape) != tuple(input_ids.shape) or not bool((attention_mask == 1).all())
        ):
            raise KVStateError(
                f"attention_mask must be all ones with the shape of input_ids {tuple(input_ids.shape)}; got shape "
                f"{tuple(attention_mask.shape)} with {int((attention_mask == 0).sum())} zeros. The prefix cache serves "
                "one unpadded sequence: strip the padding before calling prefill."
            )
        tokens = tuple(int(t) for t in input_ids[0].tolist())
        n = len(tokens)
        with self._lock:
            store = self.store
            store.tick()
            hit = store.lookup(tokens)
            prior = self._prior.weights()
            self._prior = self._prior.extended(max(n, self._prior.n))
            self._prior.record(hit.overlap if hit else 0)
            if hit is not None and hit.full:
                e = store.entry(hit.entry)
                cache = self._restore_entry(e, n - 1)
                store.record_request(tokens, hit, computed=0)
                return PrefillResult(e.final_logits.clone(), cache, n, 0, 0, 0, ones)
            start = hit.position if hit else 0
            cache = self._restore_entry(store.entry(hit.entry), start) if hit else None
            # forward calls end at the planned positions and at n-1 (the returned cache's end)
            cuts = sorted(
                set(store.wanted_positions(tokens, start, hit, prior)) | ({n - 1} if n - 1 > start else set())
            )
            out = segmented_prefill(
                self.model, input_ids, cuts=cuts, cache=cache, start=start, capture="recurrent"
            )
            kv = (
                snapshot_cache(out.cache, n, self._kinds).attention_only()
                if store.config.has_attention
                else None
            )
            rec = None
            if store.config.has_recurrent and n > 1:
                rec = out.snapshots[n - 1] if n - 1 > start else store.entry(hit.entry).checkpoints.get(n - 1)  # type: ignore[union-attr]
                if rec is None and hit is not None and n - 1 == store.entry(hit.entry).length - 1:
                    rec = store.entry(hit.entry).final
            store.record_request(
                tokens, hit, computed=n - start
            )  # before admit: it may replace the hit entry
            store.attach_captures(tokens, out.snapshots)
            if n > 1 and (rec is not None or not store.config.has_recurrent):
                store.admit(tokens, hit, kv, rec, out.logits.clone(), out.snapshots, prior)
            # hand back the state after n-1 tokens: model.generate feeds the last prompt token itself
            result_cache = self._restore(kv, rec, n - 1) if n > 1 else ResumableCache(self.config)
            return PrefillResult(
                logits=out.logits,
                cache=result_cache,
                reused_tokens=start,
                recomputed_tokens=n - start,
                new_tokens=n - (hit.overlap if hit else 0),
                lost_tokens=hit.lost if hit else 0,
                attention_mask=ones,
            )

    def lookup(self, input_ids: torch.Tensor) -> Hit | None:
        """Where a request would resume, without computing or admitting anything."""
        with self._lock:
            return self.store.lookup(tuple(int(t) for t in input_ids.reshape(-1).tolist()))
