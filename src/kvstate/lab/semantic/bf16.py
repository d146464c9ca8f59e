"""Byte counts against a **bf16** full cache: what a method holds and reads if its floating tensors were bf16.

The reference models and the converted real model run fp32, so the bench's byte counts
(:mod:`kvstate.semantic.accounting`) are fp32's: a 4-bit code is 1/8 of the fp32 element it replaces but 1/4 of
the bf16 one deployments (and the literature) hold. :func:`counts` recounts a method's cache after an answer
as the same tensors would take with every floating tensor in ``dtype`` (bf16) and every integer tensor (packed
codes) as it is, through each store's own accounting (``fast_nbytes`` / ``working_nbytes`` / ``slow_nbytes`` /
``full_nbytes``, called on a copy of the store whose floating tensors are meta tensors of ``dtype``). Every tier
is counted: anchors, summaries, routing metadata (span bounds, page min / max: for a quantized span or page
also its quantizer's key range), value ranges, the slow tier's codes, the working set. ``full_bytes`` is then
the bf16 K/V of every token seen.

Reads (``attended_bytes_peak``): every store here except KIVI's materialises floating K/V only (anchors,
summaries, reconstructed spans, fetched or dequantized pages), so its bf16 reads are its reads x
``dtype``'s element size / the cache's; :func:`counts` adds the routing metadata each pass reads beside them
(span bounds, page min / max, routing summaries), which the bench's reads leave out. KIVI reads what it holds
(codes and ranges: its attended = resident). A store that reads codes beside floating tensors (``sekv_pages*``)
counts its own reads per pass through ``pass_reads(element_size)``. A question's reads are the peak over its passes.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch

from kvstate.semantic.accounting import ByteCounts

__all__ = ["as_dtype", "counts", "routing_nbytes"]


def as_dtype(x: Any, dtype: torch.dtype) -> Any:
    """``x`` with every floating tensor in it (through lists, tuples, dicts and dataclasses) replaced by a meta
    tensor of its shape in ``dtype``; integer tensors and everything else as they are (shared, not copied)."""
    if isinstance(x, torch.Tensor):
        return torch.empty(x.shape, dtype=dtype, device="meta") if x.is_floating_point() else x
    if isinstance(x, list):
        return [as_dtype(v, dtype) for v in x]
    if isinstance(x, tuple):
        return tuple(as_dtype(v, dtype) for v in x)
    if isinstance(x, dict):
        return {k: as_dtype(v, dtype) for k, v in x.items()}
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        out = copy.copy(x)
        for f in dataclasses.fields(x):
            object.__setattr__(out, f.name, as_dtype(getattr(x, f.name), dtype))
        return out
    return x


def routing_nbytes(store: Any) -> int:
    """Bytes of the routing metadata a pass reads to choose what to expand (span bounds / page min-max /
    routing summaries); 0 for a store that routes nothing."""
    total = 0
    for name in ("k_lo", "k_hi", "page_min", "page_max"):
        t = getattr(store, name, None)
        if isinstance(t, torch.Tensor):
            total += t.nbytes
    route = getattr(store, "route", None)
    if isinstance(route, torch.Tensor):
        total += route.nbytes
    return total


def _reads_all(store: Any) -> bool:
    """Whether a pass of ``store`` reads everything it holds (KIVI: codes and ranges, not floating K/V)."""
    from kvstate.lab.semantic.methods.kivi import KiviStore

    return isinstance(store, KiviStore)


def counts(cache: Any, dtype: torch.dtype = torch.bfloat16) -> ByteCounts:
    """A method's byte counts after an answer, every floating tensor counted in ``dtype`` (module doc)."""
    layers = getattr(cache, "semantic_layers", None)
    if layers is None:  # a plain transformers cache (the full reference): every K/V it holds, read whole
        kept = full = 0
        for layer in cache.layers:
            k = getattr(layer, "keys", None)
            if k is None or not k.numel():
                continue
            kept += (k.numel() + layer.values.numel()) * torch.empty(0, dtype=dtype).element_size()
        full = kept
        return ByteCounts(kept, kept, kept, full)
    resident = total = full = 0
    reads: list[int] = []
    for layer in layers:
        st = layer.store
        if st is None:
            kv = 0 if layer.keys is None else (layer.keys.numel() + layer.values.numel()) * \
                torch.empty(0, dtype=dtype).element_size()
            resident, total, full = resident + kv, total + kv, full + kv
            continue
        cast = as_dtype(st, dtype)
        r = cast.fast_nbytes() + cast.working_nbytes()
        resident, total, full = resident + r, total + r + cast.slow_nbytes(), full + cast.full_nbytes()
        if _reads_all(st):
            mine = [cast.fast_nbytes()] * len(st.reads)  # the peak (last) pass reads all it holds
        elif hasattr(st, "pass_reads"):  # a store that reads codes: it counts its floating and code bytes itself
            mine = st.pass_reads(torch.empty(0, dtype=dtype).element_size())
        else:
            scale = torch.empty(0, dtype=dtype).element_size() / st.anchor_k.element_size()
            meta = routing_nbytes(cast)
            mine = [int(x * scale) + meta for x in st.reads]
        reads = [x + y for x, y in zip(reads, mine, strict=True)] if reads else mine
    return ByteCounts(resident, total, max(reads) if reads else 0, full)
