"""``SemanticCache``: the SEKV cache as a transformers ``Cache`` subclass.

From "SEKV: Resolution-Adaptive Semantic KV Cache with Hierarchical Semantic Memory". Prefill runs at
full resolution (each attention layer is a ``DynamicLayer``); :meth:`SemanticCache.compress` then cuts
the context into anchors and spans by its surprisal (:func:`surprisal`, from the prefill logits) so that
the fast tier fits ``(1 - expand_share) x budget`` x the full KV bytes (the rest is for expanded spans,
:class:`~kvstate.semantic.config.SemanticConfig`), and builds every layer's :class:`SpanStore`. Tokens fed
afterwards (the question, decoded tokens) are kept at full resolution and compressed into spans as they
leave the recent window. :meth:`SemanticCache.byte_counts` reports the bytes held and read
(:class:`~kvstate.semantic.accounting.ByteCounts`); :meth:`SemanticCache.slow_tier` the ranks against
their caps. Attention over a compressed layer needs the ``"sekv"`` attention function::

    cache = SemanticCache(model, router, SemanticConfig(budget=0.25))
    prefill_and_compress(model, cache, context_ids)
    with semantic_attention(model):
        model.generate(full_ids, cache=cache, max_new_tokens=16)

Works on every family whose attention layers are plain ``DynamicLayer`` (Llama, Qwen3, and the attention
layers of hybrids such as Qwen3.5; recurrent layers keep their own state). Batch size 1 only: the
boundary checks it (:func:`prefill_and_compress` refuses another batch, float or out-of-vocabulary ids,
and a context longer than the model's positions), and a cache refuses a router made for another model.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache

from kvstate.errors import BudgetError, KVStateError, UnsupportedModelError
from kvstate.models.compat import Cache, DynamicLayer, attn_implementation
from kvstate.models.families import family_of
from kvstate.semantic.accounting import ByteCounts
from kvstate.semantic.attention import SEKV
from kvstate.semantic.config import SemanticConfig
from kvstate.semantic.lowrank import byte_cap
from kvstate.semantic.router import RouterConfig, SemanticRouter
from kvstate.semantic.segment import Segmentation, fast_bytes, fit_budget, min_fast_bytes, span_weights
from kvstate.semantic.store import SlowCapError, SpanStore
from kvstate.validate import check_token_ids

__all__ = ["SemanticCache", "SemanticConfig", "SemanticLayer", "prefill_and_compress", "surprisal"]


class SemanticLayer(DynamicLayer):
    """A ``DynamicLayer`` until compressed, then a :class:`SpanStore` (fast + slow tier)."""

    def __init__(self, owner: SemanticCache, layer_idx: int) -> None:
        super().__init__()
        self.owner = owner
        self.layer_idx = layer_idx
        self.store: SpanStore | None = None
        self.seen = 0  # tokens this layer has been fed (its logical length)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        fwd = kwargs.get("kwargs")
        if isinstance(fwd, dict):  # the attention call's kwargs: hand it this layer
            fwd["semantic_layer"] = self
        self.seen += key_states.shape[2]
        if self.store is None:
            return super().update(key_states, value_states)
        if attn_implementation(self.owner.model_config) != SEKV:
            raise KVStateError("this SemanticCache is compressed, but the model's attention is "
                               f"{attn_implementation(self.owner.model_config)!r}; run the model inside "
                               "`with kvstate.semantic.semantic_attention(model):`")
        self.store.append(key_states, value_states, self.owner.router, self.layer_idx, self.owner.config)
        return self.store.anchor_k, self.store.anchor_v

    def attend(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        assert self.store is not None
        return self.store.attend(query, scaling, self.owner.router, self.layer_idx, self.owner.config)

    def get_seq_length(self) -> int:
        return self.seen

    def fork(self, owner: SemanticCache) -> SemanticLayer:
        """A copy owned by ``owner`` that shares this layer's tensors and copies its containers (see
        :meth:`SemanticCache.fork`)."""
        new = copy.copy(self)
        new.owner = owner
        if self.store is not None:
            new.store = copy.copy(self.store)
            for name, value in vars(self.store).items():  # lists / dicts of per-call records and spans
                if isinstance(value, (list, dict)):
                    setattr(new.store, name, copy.copy(value))
        return new

    def nbytes(self) -> tuple[int, int]:
        """(fast-tier bytes, slow-tier bytes) of the tensors this layer holds."""
        if self.store is None:
            return (0 if self.keys is None else self.keys.nbytes + self.values.nbytes), 0
        return self.store.fast_nbytes(), self.store.slow_nbytes()


def attention_layers(config: Any) -> list[int]:
    """Indices of the plain attention layers; raises for a family without standard attention."""
    family_of(config)
    probe = DynamicCache(config=config)
    idx = [i for i, layer in enumerate(probe.layers) if type(layer) is DynamicLayer]
    if not idx:
        raise UnsupportedModelError(f"{config.model_type!r} has no standard attention layer (per-token KV); "
                                    "SEKV compresses attention KV only")
    return idx


class SemanticCache(Cache):
    def __init__(self, model: Any, router: SemanticRouter | None = None, config: SemanticConfig | None = None) -> None:
        self.model_config = model.config
        self.config = config if config is not None else SemanticConfig()
        if not isinstance(self.config, SemanticConfig):
            raise KVStateError(f"SemanticCache: config must be a SemanticConfig, got {type(config).__name__}")
        attn = attention_layers(model.config)
        if router is not None and not isinstance(router, SemanticRouter):
            raise KVStateError(f"SemanticCache: router must be a SemanticRouter, got {type(router).__name__}")
        if router is not None:
            router.check_model(model)  # shapes, and the fingerprint of a loaded router
        self.router = router if router is not None else SemanticRouter(RouterConfig.from_model_config(model.config))
        layers: list[Any] = list(DynamicCache(config=model.config).layers)
        for i in attn:
            layers[i] = SemanticLayer(self, i)
        super().__init__(layers=layers)
        self.segmentation: Segmentation | None = None

    def adopt(self, prefilled: Cache) -> None:
        """Take over a full-resolution prefill of this cache's model held in another cache (e.g. one
        ``DynamicCache`` prefilled once and compressed under several settings): every attention layer's K/V
        is fed through this cache's own update (copied), every other layer (recurrent state) deep-copied, so
        ``prefilled`` stays as it was. Equal to prefilling this cache with the same forward call."""
        layers = self.semantic_layers
        if any(layer.seen for layer in layers):
            raise KVStateError("SemanticCache.adopt: this cache already holds tokens; adopt into a fresh cache")
        if len(prefilled.layers) != len(self.layers):
            raise KVStateError(f"SemanticCache.adopt: the prefilled cache has {len(prefilled.layers)} layers, this "
                               f"model has {len(self.layers)}; prefill with DynamicCache(config=model.config)")
        for i, (mine, theirs) in enumerate(zip(self.layers, prefilled.layers, strict=True)):
            if isinstance(mine, SemanticLayer):
                if type(theirs) is not DynamicLayer or theirs.keys is None or not theirs.keys.numel():
                    raise KVStateError(f"SemanticCache.adopt: layer {i} of the prefilled cache holds no attention "
                                       "K/V; prefill it with a forward pass first")
                mine.update(theirs.keys, theirs.values)
            else:
                self.layers[i] = copy.deepcopy(theirs)

    def fork(self, config: SemanticConfig | None = None) -> SemanticCache:
        """An independent copy to decode from — one per question asked of one compressed context — without
        copying the context: every store and ``DynamicLayer`` rebinds its tensors on update and never writes
        into them, so the copy shares the tensors and copies only the lists and dicts that record spans and
        reads; other layers (recurrent state, updated in place) are deep-copied. ``config``: decode the copy
        under settings that differ from this cache's in ``sticky`` only (the one setting compression does not
        read), so sticky and non-sticky decoding share one compression."""
        new = copy.copy(self)
        if config is not None:
            # under a memory cap the slow tier was sized beside the sticky working set: sticky is compression too
            if not isinstance(config, SemanticConfig) or dataclasses.replace(config, sticky=self.config.sticky) \
                    != self.config or (config.memory is not None and config.sticky != self.config.sticky):
                raise KVStateError(f"SemanticCache.fork: config={config!r} differs from the compressed cache's "
                                   f"{self.config!r} in more than sticky; compress a cache under that config instead")
            new.config = config
        new.layers = [layer.fork(new) if isinstance(layer, SemanticLayer) else copy.deepcopy(layer)
                      for layer in self.layers]
        return new

    @property
    def semantic_layers(self) -> list[SemanticLayer]:
        return [layer for layer in self.layers if isinstance(layer, SemanticLayer)]

    def compress(self, surprisal_values: np.ndarray | torch.Tensor) -> Segmentation:
        """Compress every attention layer's prefilled context (one surprisal per context token)."""
        s = np.asarray(surprisal_values.detach().cpu() if isinstance(surprisal_values, torch.Tensor)
                       else surprisal_values, dtype=np.float64)
        layers = self.semantic_layers
        if any(layer.store is not None for layer in layers):
            raise KVStateError("SemanticCache.compress: this cache is already compressed; compress once per context")
        t = layers[0].keys.shape[2] if layers[0].keys is not None else 0
        if t == 0 or len(s) != t:
            raise KVStateError(f"SemanticCache.compress: got {len(s)} surprisal values for a prefilled context of "
                               f"{t} tokens; prefill the context first and pass one value per token")
        seg = self.fit(s)
        return self.compress_segmentation(seg, span_weights(s, seg))

    def _memory_error(self, need: int, what: str) -> BudgetError:
        t, token_bytes, _, _ = self._sizes()
        full = t * token_bytes
        return BudgetError(f"memory {self.config.memory} of full KV ({int(self.config.memory * full)} bytes per layer) "
                           f"cannot hold {what} of a {t}-token context: the minimum is {need} bytes per layer, "
                           f"memory >= {need / full:.4f}; raise memory, lower the budget, "
                           + ("lower bits" if self.config.slow == "quant" else
                              " or ".join(f"slow={x!r}" for x in ("quant", "lowrank") if x != self.config.slow))
                           + ", or lower sinks / recent / raise max_span")

    def _held(self, seg: Segmentation) -> tuple[int, int]:
        """(fast tier, largest working set) bytes per layer of a segmentation."""
        t, token_bytes, span_bytes, _ = self._sizes()
        fast = fast_bytes(seg, token_bytes, span_bytes)
        # a sticky working set is held between passes (up to the rest of the read budget); otherwise spans are
        # expanded for one pass and dropped
        held = self.config.capped and self.config.sticky
        return fast, max(0, int(self.config.budget * t * token_bytes) - fast) if held else 0

    def slow_cap(self, seg: Segmentation) -> int | None:
        """Bytes per layer the slow tier may hold under ``memory`` (None without one): ``memory`` x the full KV
        minus the fast tier and the working set the read budget lets expanded spans take (may be negative:
        compression then names the minimum memory)."""
        if self.config.memory is None:
            return None
        t, token_bytes, _, _ = self._sizes()
        fast, working = self._held(seg)
        return int(self.config.memory * t * token_bytes) - fast - working

    def _sizes(self) -> tuple[int, int, int, int]:
        """(context tokens, bytes per token, bytes per span summary, fast-tier budget bytes) per layer."""
        k = self.semantic_layers[0].keys
        t = k.shape[2]
        token_bytes = 2 * k.shape[1] * k.shape[3] * k.element_size()
        # per span and KV head: mean key and value, the bounds (min, max key) or the routing summary; and log |S|
        per_head = (2 * k.shape[3] if self.config.attend_summaries else 0) + (2 * k.shape[3] if self.config.bounds else 0) + \
            (self.router.config.routing_dim if self.config.route_summaries else 0)
        span_bytes = k.shape[1] * per_head * k.element_size() + k.element_size()
        # "soft" (training) fits as "routed" does; "none" expands nothing and the "all" oracle everything
        share = 1.0 - self.config.expand_share if self.config.zoom in ("routed", "similarity", "soft") else 1.0
        return t, token_bytes, span_bytes, int(share * self.config.budget * t * token_bytes)

    def _refuse(self, need: int, what: str) -> BudgetError:
        t, token_bytes, _, budget = self._sizes()
        share = budget / (self.config.budget * t * token_bytes)
        return BudgetError(f"budget {self.config.budget} of full KV cannot hold the {what} of a {t}-token context "
                           f"with expand_share={self.config.expand_share}: the minimum is {need} bytes per layer, "
                           f"budget >= {need / (share * t * token_bytes):.4f}; raise the budget, lower expand_share, "
                           "or lower sinks / recent / raise max_span")

    def fit(self, surprisal_values: np.ndarray) -> Segmentation:
        """The segmentation whose fast tier fits ``(1 - expand_share) x budget`` of the context's full KV (the
        whole budget for ``"none"``, which expands nothing, and the ``"all"`` oracle, which expands everything)."""
        t, token_bytes, span_bytes, budget = self._sizes()
        need = min_fast_bytes(t, self.config.segment, token_bytes, span_bytes)
        if need > budget:
            raise self._refuse(need, "anchors (sinks, recent window) and span summaries")
        return fit_budget(surprisal_values, self.config.segment, budget, token_bytes, span_bytes)

    def check_fits(self, seg: Segmentation) -> None:
        """Raise :class:`BudgetError` naming the minimum unless ``seg``'s fast tier fits the budget's share."""
        _, token_bytes, span_bytes, budget = self._sizes()
        need = fast_bytes(seg, token_bytes, span_bytes)
        if need > budget:
            raise self._refuse(need, "anchors and span summaries of this segmentation")

    def compress_segmentation(self, seg: Segmentation, weights: list[np.ndarray]) -> Segmentation:
        """Compress every attention layer by a given segmentation (``weights``: per span, summing to 1)."""
        layers = self.semantic_layers
        if any(layer.store is not None for layer in layers):
            raise KVStateError("SemanticCache.compress: this cache is already compressed; compress once per context")
        t = layers[0].keys.shape[2] if layers[0].keys is not None else 0
        if seg.length != t:
            raise KVStateError(f"SemanticCache.compress_segmentation: a segmentation of {seg.length} tokens for a "
                               f"prefilled context of {t} tokens")
        cap = self.slow_cap(seg)
        try:  # every layer built before any is replaced: whole or nothing
            stores = [SpanStore.build(layer.keys, layer.values, seg, weights, self.router, layer.layer_idx,
                                      self.config, cap) for layer in layers]
        except SlowCapError as exc:
            fast, working = self._held(seg)
            raise self._memory_error(fast + working + exc.need, "the exact parts (sinks, anchors, recent window) with "
                                     f"the span summaries and bounds ({fast} bytes), the working set of expanded "
                                     f"spans ({working}) and the slow tier at its least ({exc.need}: {exc.what})") \
                from None
        for layer, store in zip(layers, stores, strict=True):
            layer.store = store
            layer.keys = layer.values = None
        self.segmentation = seg
        return seg

    def nbytes(self) -> dict[str, int]:
        """Fast- and slow-tier bytes over all attention layers, plus the full-KV bytes of what was seen."""
        b = self.byte_counts()
        return {"fast": sum(layer.nbytes()[0] for layer in self.semantic_layers),
                "slow": b.total_bytes - b.resident_bytes, "full": b.full_bytes}

    def byte_counts(self) -> ByteCounts:
        """Resident, total, peak attended (over the passes since compression) and full KV bytes, all layers."""
        resident = total = full = 0
        reads: list[int] = []
        for layer in self.semantic_layers:
            st = layer.store
            if st is None:
                kv = 0 if layer.keys is None else layer.keys.nbytes + layer.values.nbytes
                resident, total, full = resident + kv, total + kv, full + kv
                continue
            r = st.fast_nbytes() + st.working_nbytes()
            resident, total, full = resident + r, total + r + st.slow_nbytes(), full + st.full_nbytes()
            reads = [x + y for x, y in zip(reads, st.reads, strict=True)] if reads else list(st.reads)
        return ByteCounts(resident, total, max(reads) if reads else 0, full)

    def read_ratios(self) -> list[float]:
        """Per forward pass since compression: K/V bytes read / full KV bytes of the tokens seen then."""
        layers = [layer.store for layer in self.semantic_layers if layer.store is not None]
        if not layers:
            return []
        out = []
        for i in range(len(layers[0].reads)):
            out.append(sum(st.reads[i] for st in layers) / sum(st.full_at[i] for st in layers))
        return out

    def slow_tier(self) -> dict[str, Any]:
        """The slow tier against its budget: bytes, raw span K/V bytes, and histograms of the span ranks
        (keys and values) and of their byte caps ``n D / (n + D)``, over all attention layers."""
        ranks: dict[int, int] = {}
        caps: dict[int, int] = {}
        slow = raw = 0
        for layer in self.semantic_layers:
            st = layer.store
            if st is None:
                continue
            slow, raw = slow + st.slow_nbytes(), raw + st.raw_span_bytes
            d = st.anchor_k.shape[3]
            for (fk, fv), n in zip(st.slow, st.sizes, strict=True):
                for f in (fk, fv):
                    ranks[f.rank] = ranks.get(f.rank, 0) + 1
                    c = byte_cap(n, d)
                    caps[c] = caps.get(c, 0) + 1
        return {"slow_bytes": slow, "raw_span_bytes": raw, "budget_bytes": int(self.config.slow_budget * raw),
                "rank_histogram": dict(sorted(ranks.items())), "cap_histogram": dict(sorted(caps.items()))}

    def expanded_fraction(self) -> float:
        """Mean expanded fraction of span tokens over every attend call so far."""
        vals = [v for layer in self.semantic_layers if layer.store is not None for v in layer.store.expanded]
        return float(np.mean(vals)) if vals else 0.0


def surprisal(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``-log p(x_t | x_<t)`` per position from prefill logits (1, T, V) and ids (1, T); 0 for t = 0."""
    logp = torch.log_softmax(logits[0, :-1].float(), -1)  # (T-1, V)
    nll = -logp.gather(-1, ids[0, 1:, None]).squeeze(-1)
    return torch.cat([nll.new_zeros(1), nll])


@torch.no_grad()  # not inference_mode: recurrent layers update their state in place later
def prefill_and_compress(model: Any, cache: SemanticCache, ids: torch.Tensor) -> torch.Tensor:
    """Prefill ``ids`` (1, T) at full resolution into ``cache``, compress it, return the logits (1, T, V).

    Refused with :class:`KVStateError`: ids that are not an integer (1, T) tensor, ids outside the model's
    vocabulary, more tokens than its ``max_position_embeddings``, a cache built for another model."""
    from kvstate.models.families import text_config

    if not isinstance(cache, SemanticCache):
        raise KVStateError(f"prefill_and_compress: cache must be a SemanticCache, got {type(cache).__name__}")
    if cache.model_config is not model.config:
        raise KVStateError("prefill_and_compress: this SemanticCache was built for another model; build it with "
                           "SemanticCache(model, ...) for the model you prefill")
    tc = text_config(model.config)
    limit = getattr(tc, "max_position_embeddings", None)
    check_token_ids("prefill_and_compress ids", ids, int(tc.vocab_size),
                    max_len=limit if isinstance(limit, int) else None, error=KVStateError)
    t = ids.shape[1]
    out = model(input_ids=ids, position_ids=torch.arange(t)[None], cache=cache, use_cache=True)
    cache.compress(surprisal(out.logits, ids))
    return out.logits
