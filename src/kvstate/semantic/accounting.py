"""Byte counts of a KV method, measured from the tensors it holds and reads (one record for every method).

Every method of the resolution benchmark — full KV, SEKV, the in-project baselines, kvpress presses —
reports the same four numbers, summed over the attention layers:

- ``resident_bytes``: what stays on the model's device between forward passes (kept K/V, summaries,
  routing and page metadata, a kept working set of reconstructed spans);
- ``total_bytes``: every tier, the slow tier / offloaded pages included;
- ``attended_bytes_peak``: the largest K/V one forward pass materialises and reads — kept K/V, span
  summaries, reconstructed spans and fetched pages, the union over heads (a span or page read for one
  head is materialised for all) — the maximum over the passes so far;
- ``full_bytes``: the full K/V of every token seen (context and fed tokens).

For an evicting cache (a press, a window) resident = total = attended = the kept K/V. Ignored: the
model's weights and activations, and recurrent state (the same for every method on a hybrid).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

FIELDS = ("resident_bytes", "total_bytes", "attended_bytes_peak", "full_bytes")


@dataclass(frozen=True)
class ByteCounts:
    resident_bytes: int  # on the device between forward passes
    total_bytes: int  # every tier, slow tier and offloaded pages included
    attended_bytes_peak: int  # largest K/V materialised and read in one forward pass (union over heads)
    full_bytes: int  # the full K/V of every token seen

    def as_dict(self) -> dict[str, int]:
        return {k: int(v) for k, v in asdict(self).items()}

    def __add__(self, other: ByteCounts) -> ByteCounts:
        return ByteCounts(*(getattr(self, f) + getattr(other, f) for f in FIELDS))


def kv_bytes(cache: Any) -> int:
    """K/V bytes of a transformers cache's attention layers (layers without ``keys`` hold no per-token K/V)."""
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers
               if getattr(layer, "keys", None) is not None and layer.keys.numel())


def evicting_bytes(cache: Any, seen: int) -> ByteCounts:
    """Counts of a cache that keeps its K/V on the device and drops the rest (full KV, presses, windows).

    ``seen``: tokens fed so far. The cache only grows while a question is answered, so the K/V it holds
    after the last pass is what that pass read: the peak.
    """
    kept = kv_bytes(cache)
    full = sum(2 * layer.keys.shape[1] * layer.keys.shape[3] * layer.keys.element_size() * seen
               for layer in cache.layers if getattr(layer, "keys", None) is not None and layer.keys.numel())
    return ByteCounts(kept, kept, kept, full)
