"""``ResumableCache``: a ``DynamicCache`` that says how many tokens it covers, so ``generate`` feeds only the rest.

transformers' ``generate`` decides how many prompt tokens to feed on its first call from
``cache.get_seq_length()`` — but only when some layer of the cache is an attention layer
(``not all(cache.is_linear)``). A pure-recurrent cache (Mamba2) cannot report a length, so ``generate``
re-feeds the whole prompt on top of a state that already covers it: a silently wrong continuation
(see ``docs/upstream.md`` for the plain-transformers reproduction).

A restored cache knows the number of tokens it covers at hand-off. This subclass reports it through
the two properties ``generate`` reads, and nothing else changes:

- caches with an attention layer: transformers' own ``get_seq_length`` (exact at all times);
- pure-recurrent caches: the covered count while the cache still holds exactly the restored state
  (fingerprinted by the first layer's small conv state); once a forward pass has advanced it, the count
  is unknown and ``get_seq_length`` raises instead of letting ``generate`` re-feed silently. Such a
  cache reports its layers as not linear so that ``generate`` asks for the length; the property is read
  only by ``generate``'s prompt slicing, compiled-cache masks and offloading — none apply to a
  dynamic, non-offloaded cache of a model without attention layers.
- ``is_compileable`` is False: it is a dynamic cache (``generate`` would otherwise auto-compile a
  pure-linear cache whose type is not exactly ``DynamicCache``).

``origin`` names the model that filled the cache (its :func:`~kvstate.models.model_fingerprint`) when the
builder knows it — the prefix cache tags every cache it hands out — so a store can refuse a same-shape
cache another model computed. ``generate`` advances the same object, so the tag stays with it.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache

from kvstate.errors import KVStateError
from kvstate.models.compat import CacheLayerMixin, LinearAttentionCacheLayerMixin


class ResumableCache(DynamicCache):
    """A ``DynamicCache(config=...)`` restored at ``covered`` tokens (set by :meth:`seal`)."""

    def __init__(self, config: Any) -> None:
        super().__init__(config=config)
        self._covered = 0
        self.origin: str | None = None  # fingerprint of the model that filled it (None: not recorded)
        self._fingerprint: torch.Tensor | None = None  # first recurrent layer's conv state at seal time
        self._recurrent_only = bool(self.layers) and all(
            isinstance(layer, LinearAttentionCacheLayerMixin) and not isinstance(layer, CacheLayerMixin)
            for layer in self.layers
        )

    def seal(self, covered: int) -> ResumableCache:
        """Record that the cache now holds the state after exactly ``covered`` tokens."""
        if covered < 0:
            raise KVStateError(f"covered={covered} must be >= 0.")
        self._covered = int(covered)
        self._fingerprint = None
        if self._recurrent_only and covered > 0:
            layer = self.layers[0]
            conv = layer.conv_states[0] if isinstance(layer, LinearAttentionCacheLayerMixin) else None
            if conv is None:
                raise KVStateError(
                    f"seal({covered}): the cache holds no recurrent state; restore a state before sealing."
                )
            self._fingerprint = conv.clone()
        return self

    @property
    def covered_tokens(self) -> int:
        """Tokens the cache holds (raises for a pure-recurrent cache advanced since it was sealed)."""
        return self.get_seq_length()

    def get_seq_length(self, layer_idx: int = 0) -> int:
        if not self._recurrent_only:
            return int(super().get_seq_length(layer_idx))
        if self._fingerprint is None:
            if self._covered == 0 and not self._advanced_from_empty():
                return 0
        else:
            layer = self.layers[0]
            conv = layer.conv_states[0] if isinstance(layer, LinearAttentionCacheLayerMixin) else None
            if (
                conv is not None
                and conv.shape == self._fingerprint.shape
                and torch.equal(conv, self._fingerprint)
            ):
                return self._covered
        raise KVStateError(
            "this recurrent-only cache was advanced past the state it was restored with, and recurrent states do not "
            "record how many tokens they cover; restore a fresh cache for the next generate call, or feed only the "
            "new tokens with explicit position_ids."
        )

    def _advanced_from_empty(self) -> bool:
        layer = self.layers[0]
        return isinstance(layer, LinearAttentionCacheLayerMixin) and bool(layer.is_conv_states_initialized[0])

    @property
    def is_linear(self) -> list[bool]:
        flags = list(super().is_linear)
        return [False] * len(flags) if self._recurrent_only else flags

    @property
    def is_compileable(self) -> bool:
        return False
