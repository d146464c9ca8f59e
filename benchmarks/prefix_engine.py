"""Benchmark: sparse prefix caching on a small Qwen3.5-shaped model (CPU), ratios measured side by side.

(c) wall-clock of resuming from a checkpoint at depth c vs a full prefill, against tokens saved (linear
    fit R²), and the restore overhead as a share of the time saved;
(d) capture overhead: one prefill that ends forward calls at M planned, chunk-aligned positions and
    snapshots the recurrent state there, vs a plain one-call prefill of the same tokens.

Prints a fixed-width table, then one JSON line. Each timing is the median of interleaved repeats.
"""

from __future__ import annotations

import json
import statistics
import time

import numpy as np
import torch

from kvstate.models import restore_cache, segmented_prefill, snapshot_cache, tiny_model
from kvstate.models.families import layer_kinds

torch.set_num_threads(1)  # one thread: less sensitive to other load on a shared 2-core machine
REPEATS = 7
N = 2048
ALIGN = 64


def main() -> None:
    model = tiny_model("qwen3_5", seed=0, hidden_size=256, intermediate_size=512, num_hidden_layers=8,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=4,
                       linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64, vocab_size=1024)
    kinds = layer_kinds(model.config)
    ids = torch.randint(0, 1024, (1, N), generator=torch.Generator().manual_seed(0))
    cuts = [ALIGN * k for k in range(1, N // ALIGN)][:: (N // ALIGN) // 8][:8]  # 8 chunk-aligned checkpoints

    # warm up
    segmented_prefill(model, ids[:, :256])

    full = segmented_prefill(model, ids, cuts=cuts, capture="full")
    depths = [0, *cuts[::2], cuts[-1]]
    # every configuration is timed once per round, rounds interleaved, medians reported
    times: dict[str, list[float]] = {k: [] for k in ["plain", "capture", *(f"resume{c}" for c in depths[1:]),
                                                      *(f"restore{c}" for c in depths[1:])]}

    def timed(key, fn):
        t0 = time.perf_counter()
        fn()
        times[key].append(time.perf_counter() - t0)

    for _ in range(REPEATS):
        timed("plain", lambda: segmented_prefill(model, ids, capture=None))

        def capture_pass():
            out = segmented_prefill(model, ids, cuts=cuts, capture="recurrent")
            snapshot_cache(out.cache, N, kinds)  # the entry's KV + final state, as the engine stores it

        timed("capture", capture_pass)
        for c in depths[1:]:
            snap = full.snapshots[c]
            timed(f"restore{c}", lambda snap=snap: restore_cache(model.config, snap))
            timed(f"resume{c}", lambda snap=snap, c=c: segmented_prefill(
                model, ids, cache=restore_cache(model.config, snap), start=c, capture=None))
    med = {k: statistics.median(v) for k, v in times.items()}
    plain, capture = med["plain"], med["capture"]
    rows = [(0, plain, 0.0)] + [(c, med[f"resume{c}"], med[f"restore{c}"]) for c in depths[1:]]
    t_full = rows[0][1]
    saved = np.array([t_full - r[1] for r in rows])
    tokens = np.array([r[0] for r in rows], dtype=float)
    slope, intercept = np.polyfit(tokens, saved, 1)
    pred = slope * tokens + intercept
    r2 = 1 - float(((saved - pred) ** 2).sum() / ((saved - saved.mean()) ** 2).sum())
    overheads = [r[2] / (t_full - r[1]) for r in rows[1:] if t_full - r[1] > 0]

    print(f"{'restore at c':>12} {'resume s':>10} {'restore s':>10} {'saved s':>10}")
    for (c, tr, tre), s in zip(rows, saved, strict=True):
        print(f"{c:>12d} {tr:>10.4f} {tre:>10.5f} {s:>10.4f}")
    print(f"full prefill {N} tokens: {t_full:.4f} s; linear fit of time saved vs tokens saved: R^2 = {r2:.4f}")
    print(f"restore overhead / time saved: median {statistics.median(overheads):.4f}, max {max(overheads):.4f}")
    print(f"capture (8 checkpoints + entry snapshot) / plain prefill = {capture / plain:.3f}")
    print(json.dumps({
        "benchmark": "prefix_engine", "n_tokens": N, "align": ALIGN, "full_prefill_s": t_full,
        "fit_r2": r2, "restore_overhead_median": statistics.median(overheads), "restore_overhead_max": max(overheads),
        "capture_ratio": capture / plain, "rows": [{"c": c, "resume_s": tr, "restore_s": tre} for c, tr, tre in rows],
    }))


if __name__ == "__main__":
    main()
