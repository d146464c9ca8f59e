"""``SparsePrefixCache``: sparse prefix caching for hybrid / recurrent HF models, served one request at a time.

"Sparse Prefix Caching for Hybrid and Recurrent LLM Serving" keeps dense attention KV and recurrent
states at sparse, planned positions. This engine drives the radix store (``store.py``) with one
transaction per request: ``begin`` (match, record the true overlap, pin, plan, say what to capture),
a forward pass over the suffix only whose calls end at the positions to capture (no second prefill),
then ``commit`` (insert the suffix's KV once into the tree, the captured states and the logits, evict
unpinned leaves under the byte budget) — or ``abort`` if the forward pass failed. Output equals the
same segmented computation bit for bit.

With ``grid=GridConfig(...)`` a prefill also captures the recurrent state on a coarse block grid within a
byte share (:mod:`kvstate.prefix.grid`), so the second sighting of a prefix resumes at most one block before
where it diverges; the exact placement refines (and thins) it as overlaps are observed.

With ``PrefixCacheConfig(remote="redis://...")`` the engine also writes what it computed through to a
shared tier and, on a local miss, resumes from there (``shared_tier.py``): replicas of one model share
their prefixes.

Batch of one: each call serves one unpadded sequence. The store verbs run under one lock; forward
passes run outside it, so requests on several threads overlap (what they use is pinned).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
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
    model_fingerprint,
    segmented_prefill,
    snapshot_cache,
)
from kvstate.prefix.config import PrefixCacheConfig
from kvstate.prefix.events import CacheEvents
from kvstate.prefix.grid import GridConfig, GridLedger, affordable, grid_positions, grid_step, to_thin
from kvstate.prefix.hashing import path_hash
from kvstate.prefix.placement import Placement, plan_checkpoints
from kvstate.prefix.remote import RedisTier, RemoteTier
from kvstate.prefix.segments import build_cache, kv_segment, split_segment, to_device
from kvstate.prefix.shared_tier import Layout, RemoteMetrics, SharedTier, layout_of, load_key
from kvstate.prefix.store import Hit, PrefixStore, StoreConfig, StoreMetrics, Txn

# the attribute a cache handed out carries: (tokens it covers, their path hash), checked by insert()
TOKEN_PATH = "token_path"


@dataclass
class PrefillResult:
    logits: torch.Tensor  # (1, V) logits of the last position
    # the first T-1 tokens: model.generate(input_ids, cache=..., attention_mask=...) feeds the last one;
    # with prefill(..., full_state=True) all T tokens (decode from `logits`, feeding the new token at T)
    cache: ResumableCache
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
        placement: Placement | str = Placement.PATH,
        remote_tier: RemoteTier | None = None,
        grid: GridConfig | None = None,
    ) -> None:
        """``remote_tier``: the shared tier's byte store (default: :class:`RedisTier` on ``config.remote``;
        tests pass their own). ``grid``: grid checkpoints for first sightings (None: off, as before)."""
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
        self.vocab_size = vocab
        self._dtype = dtype
        # what every cache this engine hands out is tagged with, and what insert() asks of a cache
        self.fingerprint = model_fingerprint(model)
        self.events = CacheEvents(self.fingerprint, self.align)  # store / evict events for a cache-aware router
        self.store = PrefixStore(
            StoreConfig(
                budget_bytes=cfg.budget_bytes,
                slots_per_entry=cfg.slots_per_entry,
                checkpoint_bytes=checkpoint_bytes(model.config, dtype) if has_rec else 0,
                kv_bytes_per_token=kv_bytes_per_token(model.config, dtype) if has_attn else 0,
                logits_bytes=vocab * dtype.itemsize,
                has_recurrent=has_rec,
                has_attention=has_attn,
                policy=cfg.policy,
                alpha=cfg.alpha,
                flops_per_token=2.0 * n_params,
                placement=cfg.placement,
                align=self.align,
                capture_min_saving=(
                    self.align / 2 if cfg.capture_min_saving is None else float(cfg.capture_min_saving)
                ),
            ),
            planner=self._plan,
            splitter=split_segment,
            sizer=held_nbytes,
            observer=self._heard,
        )
        self.grid = grid
        on = grid is not None and grid.enabled and has_rec
        self._grid_step = grid_step(grid.block, self.align) if on and grid is not None else 0
        self._grid_budget = int(cfg.budget_bytes * grid.budget_share) if on and grid is not None else 0
        self._grid_each = self.store.config.checkpoint_bytes  # a grid state's bytes (the last one measured)
        self.grid_ledger = GridLedger()  # the grid states held now and their bytes
        self._lock = threading.Lock()
        self._shared: SharedTier | None = None
        self._layout_memo: Layout | None = None
        if cfg.remote is not None or remote_tier is not None:
            key = load_key(cfg.remote_key_file)
            tier = remote_tier if remote_tier is not None else RedisTier(str(cfg.remote))
            self._shared = SharedTier(tier, self.fingerprint, self.align, self._kinds, cfg.remote_retry_s, key)
            self._shared.layout = self._layout()

    def _heard(self, event: str, kind: str, tokens: tuple[int, ...], start: int) -> None:
        """The store's observer: the cache events, and the grid ledger's bookkeeping."""
        self.events(event, kind, tokens, start)
        self.grid_ledger.heard(event, kind, tokens)

    # -- grid checkpoints (kvstate.prefix.grid); the store has no verb that drops one state, so these use
    # its walk and its state removal, which keep its byte counters and events right; called under the lock
    def _grid_cuts(self, start: int, n: int, capture: Sequence[int]) -> list[int]:
        """Grid positions this pass also captures: multiples of the grid step past the resume point, before
        the end states, not planned already, as many as the grid's byte share could hold."""
        if not self._grid_step:
            return []
        planned = set(capture)
        cands = [p for p in grid_positions(start, n - 1, self._grid_step) if p not in planned]
        return affordable(cands, self._grid_each, 0, self._grid_budget)

    def _drop_grid_state(self, tokens: tuple[int, ...], p: int) -> None:
        path, _ = self.store._walk(tokens[:p])
        self.store._drop_state(path, p)

    def _grid_room(self, sizes: dict[int, int]) -> dict[int, int]:
        """Evict the least recently used grid states until ``sizes`` fit the grid's share; what still does
        not fit (the deepest first) is not kept."""
        need = sum(sizes.values())
        led = self.grid_ledger
        if led.nbytes + need > self._grid_budget:
            clock = []
            for e in led.entries():
                path, _ = self.store._walk(e.tokens[: e.position])
                st = self.store._find_state(path, e.position)
                clock.append((st.last_access if st is not None else -1, e.position, e))
            for _, _, e in sorted(clock, key=lambda x: (x[0], x[1])):
                if led.nbytes + need <= self._grid_budget:
                    break
                self._drop_grid_state(e.tokens, e.position)
        keep = dict(sizes)
        for p in sorted(sizes, reverse=True):
            if led.nbytes + sum(keep.values()) <= self._grid_budget:
                break
            del keep[p]
        return keep

    def _thin_grid(self, txn: Txn) -> None:
        """After a served request: drop the grid states on its shared path that the exact plan does not keep,
        where at least ``thin_after`` overlaps were observed."""
        g, t = self.grid, min(txn.hit.overlap, len(txn.tokens))
        if g is None or g.thin_after <= 0 or not self._grid_step or t < self._grid_step:
            return
        held = self.grid_ledger.held_at(txn.tokens, grid_positions(0, t + 1, self._grid_step))
        if not held:
            return
        path, _ = self.store._walk(txn.tokens[:t])
        observed = [(p, next((v.sub_mass for v in path if v.top < p <= v.depth), 0.0)) for p in held]
        for p in to_thin(held, txn.plan, txn.hit.position, observed, g.thin_after):
            self._drop_grid_state(txn.tokens, p)

    def _layout(self) -> Layout:
        """This model's per-layer state shapes and dtypes, from one token's forward (once): what the shared
        tier checks its reads against and what :meth:`insert` checks a foreign cache against."""
        if self._layout_memo is None:
            ids = torch.zeros((1, 1), dtype=torch.long, device=self._device)
            with torch.no_grad():
                out = segmented_prefill(self.model, ids, cuts=[1], capture="recurrent")
            has_att = self.store.config.has_attention
            kv = kv_segment(out.cache, 0, 1, self._kinds, "cpu") if has_att else None
            snap = out.snapshots[1] if self.store.config.has_recurrent else None
            self._layout_memo = layout_of(kv, snap)
        return self._layout_memo

    def _check_cache(self, cache: Any, covered: int) -> None:
        """Refuse a cache another model built: its layers' kinds, shapes and dtypes must be this model's."""
        lay = self._layout()
        layers = getattr(cache, "layers", None)
        fix = "insert only caches this model built (prefill's result or model.generate(..., cache=...))."
        if layers is None or len(layers) != len(self._kinds):
            got = "no layers" if layers is None else f"{len(layers)} layers"
            raise KVStateError(f"insert: cache has {got}, this model has {len(self._kinds)}; {fix}")
        for i, layer in enumerate(layers):
            if i in lay.kv:
                shape, dtype = lay.kv[i]
                keys = getattr(layer, "keys", None)
                want = tuple(covered if d == -1 else d for d in shape)  # the token count is checked below
                got_shape = None if not isinstance(keys, torch.Tensor) else tuple(keys.shape)
                same = got_shape is not None and len(got_shape) == len(shape) and all(
                    d == -1 or g == d for g, d in zip(got_shape, shape, strict=True)
                )
                if not same or keys.dtype != dtype:
                    got = "no KV" if not isinstance(keys, torch.Tensor) else f"{tuple(keys.shape)} {keys.dtype}"
                    raise KVStateError(
                        f"insert: cache layer {i} holds {got}; this model's attention KV is {want} {dtype}; {fix}"
                    )
            if i in lay.rec:
                conv, ssm, cdt, sdt = lay.rec[i]
                c = getattr(layer, "conv_states", [None])[0] if getattr(layer, "conv_states", None) else None
                r = getattr(layer, "recurrent_states", [None])[0] if getattr(layer, "recurrent_states", None) else None
                ok = isinstance(c, torch.Tensor) and isinstance(r, torch.Tensor)
                # shapes must agree; the state's float dtype may differ (generate keeps bf16, prefill fp32)
                if not ok or (tuple(c.shape), tuple(r.shape)) != (conv, ssm) or not (
                    c.dtype.is_floating_point and r.dtype.is_floating_point
                ):
                    got = "no recurrent state" if not ok else f"conv {tuple(c.shape)} {c.dtype}, state {tuple(r.shape)} {r.dtype}"
                    raise KVStateError(
                        f"insert: cache layer {i} holds {got}; this model's is conv {conv} {cdt}, state {ssm} {sdt}; {fix}"
                    )

    # -- metrics (immutable snapshots; safe from any thread) -------------------------------------
    @property
    def metrics(self) -> StoreMetrics:
        with self._lock:
            return self.store.metrics()

    @property
    def remote_metrics(self) -> RemoteMetrics | None:
        """The shared tier's counters and its ``up`` gauge (None without ``remote``)."""
        return None if self._shared is None else self._shared.metrics()

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
        """One unpadded sequence of this model's token ids, as ``(1, T)`` and a tuple; else a KVStateError."""
        if not isinstance(input_ids, torch.Tensor):
            raise KVStateError(
                f"input_ids must be a torch.Tensor of token ids, got {type(input_ids).__name__}; pass "
                "torch.tensor([ids])."
            )
        if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
            raise KVStateError(
                f"input_ids has dtype {input_ids.dtype}; token ids must be integers (a float id would be truncated): "
                "pass the tokenizer's ids, or input_ids.long() if they are whole numbers."
            )
        if input_ids.dim() == 1:
            input_ids = input_ids.unsqueeze(0)
        if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] == 0:
            raise KVStateError(
                f"input_ids must be one non-empty sequence, shape (T,) or (1, T); got shape "
                f"{tuple(input_ids.shape)}. The prefix cache serves a batch of one: call it once per sequence."
            )
        lo, hi = int(input_ids.min()), int(input_ids.max())
        if lo < 0 or hi >= self.vocab_size:
            bad = lo if lo < 0 else hi
            raise KVStateError(
                f"input_ids holds token id {bad}, outside this model's vocabulary 0..{self.vocab_size - 1}; "
                "tokenize with the model's own tokenizer."
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

    def _tagged(self, cache: ResumableCache, tokens: tuple[int, ...], covered: int) -> ResumableCache:
        """Tag a cache handed out with this model and the tokens it covers (``insert`` checks both)."""
        cache.origin = self.fingerprint
        setattr(cache, TOKEN_PATH, (covered, path_hash(self.fingerprint, tokens[:covered])))
        return cache

    def _check_path(self, cache: Any, tokens: tuple[int, ...]) -> None:
        """Refuse a cache filed under tokens other than those it was computed for (as the shared tier refuses
        an entry whose token-path hash differs): its recorded path must be a prefix of ``tokens``."""
        recorded = getattr(cache, TOKEN_PATH, None)
        if recorded is None:
            return
        covered, digest = recorded
        if covered > len(tokens) or path_hash(self.fingerprint, tokens[:covered]) != digest:
            raise KVStateError(
                f"insert: the cache was computed for other tokens than the first {covered} of input_ids; insert "
                "a cache under the ids it was prefilled for (plus what generate appended)."
            )

    def _resume_remote(
        self, tokens: tuple[int, ...], start: int, cands: set[int]
    ) -> tuple[tuple[int, list[Any], Any], ResumableCache] | None:
        """A deeper resume point from the shared tier and the cache rebuilt there; None on a miss. Whatever
        goes wrong with a remote entry is a counted refusal and a local computation, never the request's error."""
        assert self._shared is not None
        try:
            remote = self._shared.lookup(tokens, start, cands)
            if remote is None:
                return None
            p, parts, state = remote
            return remote, build_cache(self.model.config, self._kinds, parts, state, p, self._device)
        except Exception as exc:  # an entry that passed the checks and still fails to restore
            self._shared.refused(f"restore failed ({type(exc).__name__})")
            return None

    def _restore(self, txn: Txn, length: int) -> ResumableCache:
        return build_cache(self.model.config, self._kinds, list(txn.kv), txn.state, length, self._device)

    @torch.no_grad()
    def prefill(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        boundaries: Sequence[int] | None = None,
        *,
        full_state: bool = False,
        chunk: int | None = None,
        between: Callable[[], None] | None = None,
    ) -> PrefillResult:
        """Serve one prompt. ``attention_mask`` may be given but must be all ones (a batch of one, no padding):
        the cache is built with positions ``0..T-1``, which is what ``generate`` uses for an all-ones mask.

        ``boundaries``: positions (strictly increasing, in ``1..T``) where later requests are expected to
        part from this one — the end of a document or of each chat message (:func:`chat_boundaries`). The
        state there is captured in this same pass while it pays off (it competes with the planned positions
        for ``slots_per_entry``; ``docs/techniques.md#position``), so the next request sharing the prefix up
        to a boundary resumes from it.

        ``full_state=True``: the returned cache holds all ``T`` tokens, for a caller with its own decode loop
        (sample from ``logits``, feed the new token at position ``T``). The pass is then one forward call
        fewer: the end state kept for later requests is the one after ``T`` tokens, which the pass ends on,
        instead of after ``T-1``, which needs a call boundary there.

        ``chunk`` / ``between``: chunked prefill for a batching server — no forward call covers more than
        ``chunk`` tokens and ``between()`` runs after every ``chunk`` tokens at most (the server decodes its
        running batch there; checkpoint cuts inside a chunk split its forward calls, not the step:
        :func:`budgeted`); what this request restores stays pinned meanwhile."""
        input_ids, tokens = self._tokens(input_ids, attention_mask)
        n = len(tokens)
        end = n if full_state else n - 1  # the end state this request keeps, and the returned cache's length
        ones = torch.ones_like(input_ids)
        with self._lock:
            txn = self.store.begin(
                tokens, boundaries=() if boundaries is None else boundaries, full_state=full_state
            )
            hit, start = txn.hit, txn.hit.position
            if hit.full:  # nothing to compute or insert: the stored logits and end state
                try:
                    logits = txn.logits.to(self._device, copy=True)
                    cache_out = self._tagged(self._restore(txn, end), tokens, end)
                    served = PrefillResult(logits, cache_out, n, 0, 0, 0, ones)
                except BaseException:
                    self.store.abort(txn)
                    raise
                self.store.commit(txn, {}, None)  # learns from the request and counts it
                self._thin_grid(txn)
                return served
        try:
            # on a local miss, the shared tier may hold a deeper state (another replica computed it)
            remote, resumed = None, None
            if self._shared is not None:
                declared = set(() if boundaries is None else boundaries)
                cands = set(txn.capture) | declared | set(range(self.align, n, self.align)) | {n - 1}
                resumed = self._resume_remote(tokens, start, cands)
            remote_state = None
            cache: ResumableCache | None
            if resumed is not None:
                remote, cache = resumed
                start, parts, remote_state = remote
            else:
                # what it restores is pinned; an empty resumable cache when the pass returns it as is
                cache = self._restore(txn, start) if start or full_state else None
            rec = self.store.config.has_recurrent
            capture = [p for p in txn.capture if p > start]
            with self._lock:
                grid = self._grid_cuts(start, n, capture)
            cuts = sorted(set(capture) | set(grid) | ({end} if rec and end > start else set()))
            result_cache: ResumableCache
            if remote is not None and start == end:  # the forward pass below advances `cache` in place
                result_cache = build_cache(self.model.config, self._kinds, parts, remote_state, start, self._device)
            out = segmented_prefill(
                self.model, input_ids, cuts=cuts, cache=cache, start=start, capture="recurrent", chunk=chunk,
                between=budgeted(between, start, n, cuts, chunk),
            )
            dev = self.config.state_device
            states = {p: to_device(out.snapshots[p], dev) for p in capture}
            grid_states = {p: to_device(out.snapshots[p], dev) for p in grid}
            if remote_state is not None and start in txn.capture:
                states[start] = to_device(remote_state, dev)
            if full_state:
                assert isinstance(out.cache, ResumableCache)
                result_cache = out.cache.seal(n)  # all n tokens, no copy: the store copies what it keeps
            elif rec and n - 1 > start:
                result_cache = build_cache(
                    self.model.config,
                    self._kinds,
                    [],
                    out.snapshots[n - 1],
                    n - 1,
                    self._device,
                    live=out.cache,
                )
            elif remote is not None and start == n - 1:
                pass  # built above
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
            if grid_states:
                measured = {p: held_nbytes(s) for p, s in grid_states.items()}
                self._grid_each = max(measured.values())
                sizes = self._grid_room(measured)
                states |= {p: grid_states[p] for p in sizes}
                self.grid_ledger.expect(tokens, sizes)
            try:
                self.store.commit(txn, states, kv if self.store.config.has_attention else None, logits)
            finally:
                self.grid_ledger.settle()
            self._thin_grid(txn)
        if self._shared is not None:  # write through what this pass computed (grid states stay local)
            written = [p for p in cuts if p not in grid_states]
            self._shared.write(tokens, start, live, {p: out.snapshots[p] for p in written}, n)
        return PrefillResult(
            logits=out.logits,
            cache=self._tagged(result_cache, tokens, end),
            reused_tokens=start,
            recomputed_tokens=n - start,
            new_tokens=n - hit.overlap,
            lost_tokens=hit.lost,
            attention_mask=ones,
        )

    @torch.no_grad()
    def insert(self, input_ids: torch.Tensor, cache: Any, covered: int | None = None, *, trusted: bool = False) -> bool:
        """Cache what a forward pass or ``generate`` already computed: ``cache`` holds the state after the
        first ``covered`` tokens of ``input_ids`` (default ``T-1``: what ``generate`` leaves for its output
        sequence). Returns False when it did not fit the budget (the store is then unchanged).

        The cache must carry this model's fingerprint (``cache.origin``: every cache :meth:`prefill` returns
        does, and ``generate`` keeps it); ``trusted=True`` takes a cache you filled with this model yourself.
        A cache :meth:`prefill` returned also records the tokens it covers: ``input_ids`` must start with them."""
        input_ids, tokens = self._tokens(input_ids, None)
        covered = len(tokens) - 1 if covered is None else int(covered)
        if not 0 < covered <= len(tokens):
            raise KVStateError(f"covered={covered} must be in 1..{len(tokens)} (the tokens the cache holds).")
        self._check_cache(cache, covered)
        origin = cache.origin if isinstance(cache, ResumableCache) else None
        if not trusted and origin != self.fingerprint:
            got = "carries no origin" if origin is None else f"was filled by model {origin[:12]}…"
            raise KVStateError(
                f"insert: the cache {got}, not this model ({self.fingerprint[:12]}…); insert caches this engine's "
                "prefill returned (generate keeps their tag), or pass trusted=True for a cache this model filled."
            )
        self._check_path(cache, tokens)  # the model first (the more telling error), then the tokens
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
            stored = self.store.commit(
                txn, states, kv if self.store.config.has_attention else None, None, covered
            )
        if self._shared is not None:  # write through past what the store already held
            self._shared.write(tokens, min(txn.hit.overlap, covered), cache, states, covered)
        return stored

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

    def lookup(self, input_ids: torch.Tensor, full_state: bool = False) -> Hit:
        """Where a request would resume (served as ``prefill(..., full_state=...)``), without computing,
        recording or inserting anything."""
        _, tokens = self._tokens(input_ids, None)
        with self._lock:
            return self.store.lookup(tokens, full_state)

    def computed_tokens(self, token_ids: Sequence[int]) -> int:
        """Prompt tokens a request for ``token_ids`` would restore instead of computing (served with its own
        decode loop, ``full_state=True``): the scheduler's one question to the prefix cache before it admits a
        request (vLLM's ``get_computed_blocks``). Nothing is computed, recorded or pinned."""
        if not token_ids:
            return 0
        return int(self.lookup(torch.tensor([list(token_ids)], device=self._device), full_state=True).position)


def budgeted(between: Callable[[], None] | None, start: int, total: int, cuts: Sequence[int],
             chunk: int | None) -> Callable[[], None] | None:
    """``between`` called only where the next forward call would take the tokens since the last call of it past
    ``chunk``: a step of a batching server then carries up to ``chunk`` prefill tokens, however many checkpoint
    cuts split them into forward calls (each cut alone would be a step, a decode stall, and a later first token).
    The forward calls are :func:`~kvstate.models.prefill.segmented_prefill`'s: one per bound, in order."""
    if between is None or chunk is None:
        return between
    bounds = sorted({c for c in cuts if start < c <= total} | {total} | set(range(start + chunk, total, chunk)))
    state = {"call": 0, "since": start}

    def maybe() -> None:
        i = state["call"]
        state["call"] = i + 1
        if i + 1 < len(bounds) and bounds[i + 1] - state["since"] <= chunk:
            return  # the next call still fits this step's budget
        state["since"] = bounds[i]
        between()

    return maybe
