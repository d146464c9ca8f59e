"""Wall-clock of sparse prefix caching on a real (small) model: resume vs full prefill, restore and capture.

Seed 000 reports that wall-clock savings track saved tokens linearly and that restoring a checkpoint
costs little against the recompute it saves; this measures both here, plus the overhead of capturing
checkpoints inside the prefill pass. Every configuration is timed once per round, rounds interleaved,
medians reported: ratios measured side by side are what survive a shared, noisy machine.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvstate.models import layer_kinds, restore_cache, segmented_prefill, snapshot_cache, tiny_model


@dataclass(frozen=True)
class EngineTiming:
    n_tokens: int  # prompt length
    depths: list[int]  # restore depths c (0 = full prefill)
    resume_s: list[float]  # median seconds to restore at c and compute the rest
    restore_s: list[float]  # median seconds of the restore alone
    capture_ratio: float  # prefill with checkpoint capture / plain prefill
    fit_r2: float  # linear fit of time saved vs tokens saved
    restore_overhead_max: float  # max over c of restore time / time saved
    capture_ratios: list[float] = field(default_factory=list)  # capture / plain per interleaved round (the spread)

    def as_json(self) -> dict[str, Any]:
        return self.__dict__.copy()


def bench_model(seed: int = 0) -> Any:
    """A small Qwen3.5-shaped hybrid (6 Gated DeltaNet + 2 attention layers, hidden 256) for timing."""
    return tiny_model("qwen3_5", seed=seed, hidden_size=256, intermediate_size=512, num_hidden_layers=8,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=4,
                      linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64, vocab_size=1024)


@torch.no_grad()
def measure_engine(model: Any, n: int = 2048, align: int = 64, slots: int = 8, repeats: int = 7,
                   seed: int = 0) -> EngineTiming:
    kinds = layer_kinds(model.config)
    ids = torch.randint(0, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(seed))
    grid = [align * k for k in range(1, n // align)]
    cuts = sorted({grid[int(i)] for i in np.linspace(0, len(grid) - 1, slots).round()})  # spread over the prompt
    full = segmented_prefill(model, ids, cuts=cuts, capture="full")
    depths = [0, *cuts[::2], cuts[-1]]
    times: dict[str, list[float]] = {}

    def timed(key: str, fn: Callable[[], object]) -> None:
        t0 = time.perf_counter()
        fn()
        times.setdefault(key, []).append(time.perf_counter() - t0)

    def capture_pass() -> None:
        out = segmented_prefill(model, ids, cuts=cuts, capture="recurrent")
        snapshot_cache(out.cache, n, kinds)  # the entry's KV + final state, as the engine stores them

    segmented_prefill(model, ids[:, : min(n, 256)])  # warm-up
    for _ in range(repeats):
        timed("plain", lambda: segmented_prefill(model, ids, capture=None))
        timed("capture", capture_pass)
        for c in depths[1:]:
            snap = full.snapshots[c]
            timed(f"restore{c}", lambda snap=snap: restore_cache(model.config, snap))
            timed(f"resume{c}", lambda snap=snap, c=c: segmented_prefill(
                model, ids, cache=restore_cache(model.config, snap), start=c, capture=None))
    med = {k: statistics.median(v) for k, v in times.items()}
    resume = [med["plain"]] + [med[f"resume{c}"] for c in depths[1:]]
    restore = [0.0] + [med[f"restore{c}"] for c in depths[1:]]
    saved = np.array([resume[0] - r for r in resume])
    tokens = np.array(depths, dtype=float)
    slope, intercept = np.polyfit(tokens, saved, 1)
    resid = saved - (slope * tokens + intercept)
    r2 = 1.0 - float((resid**2).sum() / max(((saved - saved.mean()) ** 2).sum(), 1e-30))
    overheads = [r / s for r, s in zip(restore[1:], saved[1:], strict=True) if s > 0]
    rounds = [c / p for c, p in zip(times["capture"], times["plain"], strict=True)]
    return EngineTiming(n, depths, resume, restore, med["capture"] / med["plain"], r2,
                        max(overheads) if overheads else float("nan"), rounds)
