"""Deployment cost of cross-layer KV sharing, measured through ``model.generate`` (R-CLA, "Stochastic KV Routing").

For each kept fraction the model runs under its sharing pattern (:func:`kvstate.depth.sharing.apply_sharing`)
and generates from a ``context``-token prompt into a :func:`~kvstate.depth.sharing.sharing_cache`, as a
user deploys it. A streamer stamps the time of every token ``generate`` emits, so one call gives the
prefill (prompt to first token) and the decode rate ``(new_tokens - 1) / (t_last - t_first)`` without
subtracting two noisy calls; repeats interleave the keeps so load on a shared machine spreads over all of
them, and the median and spread are reported beside the full cache's (keep 1). ``cache_bytes`` is measured from the cache's tensors after generation
(:func:`kvstate.models.accounting.cache_nbytes`): the resident KV a deployment holds at that length.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from kvstate.errors import KVStateError


def decode_benchmark(model: Any, keeps: Sequence[float], *, context: int = 2048, new_tokens: int = 32,
                     repeats: int = 5, seed: int = 0, kind: str = "keep") -> list[dict[str, Any]]:
    """One row per keep: ``keep, pattern, context, new_tokens, decode_tok_s, decode_tok_s_range,
    prefill_s, cache_bytes, cache_bytes_vs_full, decode_speedup_vs_full`` (medians over ``repeats``)."""

    from kvstate.depth.attention import layer_specs
    from kvstate.depth.patterns import for_keep, format_pattern
    from kvstate.depth.sharing import apply_sharing, sharing_cache
    from kvstate.models.accounting import cache_nbytes
    from kvstate.models.compat import base_streamer

    BaseStreamer = base_streamer()

    if new_tokens < 2 or repeats < 1 or context < 1:
        raise KVStateError(f"decode benchmark: need new_tokens >= 2, repeats >= 1, context >= 1 "
                           f"(got {new_tokens}, {repeats}, {context})")
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and context + new_tokens > limit:
        raise KVStateError(f"decode benchmark: context {context} + {new_tokens} new tokens exceeds the model's "
                           f"{limit} positions; pass a shorter --context")
    specs = layer_specs(model.config)
    patterns = [(float(k), for_keep(specs, kind, k)) for k in keeps]  # bad fractions fail before any timing
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (1, context), generator=gen)

    class Clock(BaseStreamer):
        """Stamps each ``put``: the prompt first, then every new token."""

        def __init__(self) -> None:
            self.stamps: list[float] = []

        def put(self, value: Any) -> None:
            self.stamps.append(time.perf_counter())

        def end(self) -> None:
            pass

    def run(pattern: Any) -> tuple[float, float, int]:
        cache, clock = sharing_cache(model.config, pattern), Clock()
        out = model.generate(ids, cache=cache, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             streamer=clock)
        t = clock.stamps
        if out.shape[1] != context + new_tokens or len(t) != new_tokens + 1:
            raise KVStateError(f"decode benchmark: generate returned {out.shape[1] - context} tokens, asked {new_tokens}")
        return t[1] - t[0], (new_tokens - 1) / (t[-1] - t[1]), cache_nbytes(cache)

    prefill: dict[float, list[float]] = {k: [] for k, _ in patterns}
    rates: dict[float, list[float]] = {k: [] for k, _ in patterns}
    held: dict[float, int] = {}
    with torch.inference_mode():
        for _ in range(repeats):
            for keep, pattern in patterns:
                with apply_sharing(model, pattern):
                    p, r, held[keep] = run(pattern)
                prefill[keep].append(p)
                rates[keep].append(r)
    rows = []
    for keep, pattern in patterns:
        rs = rates[keep]
        rows.append({"keep": keep, "pattern": format_pattern(pattern), "context": context, "new_tokens": new_tokens,
                     "decode_tok_s": round(statistics.median(rs), 2),
                     "decode_tok_s_range": [round(min(rs), 2), round(max(rs), 2)],
                     "prefill_s": round(statistics.median(prefill[keep]), 4), "cache_bytes": held[keep]})
    full = next((r for r in rows if r["keep"] == 1.0), None)
    for r in rows:
        r["cache_bytes_vs_full"] = round(r["cache_bytes"] / full["cache_bytes"], 4) if full else None
        r["decode_speedup_vs_full"] = round(r["decode_tok_s"] / full["decode_tok_s"], 3) if full else None
    return rows


__all__ = ["decode_benchmark"]
