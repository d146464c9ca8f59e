"""Benchmark: sparse prefix caching on a small Qwen3.5-shaped model (CPU), ratios measured side by side.

(c) wall-clock of resuming from a checkpoint at depth c vs a full prefill, against tokens saved (linear
    fit R²), and the restore overhead as a share of the time saved;
(d) capture overhead: one prefill that ends forward calls at 8 planned, chunk-aligned positions and
    snapshots the state there, vs a plain one-call prefill of the same tokens.

Prints a fixed-width table, then one JSON line (see kvstate.lab.prefix.timing for the method).
"""

from __future__ import annotations

import json

import torch

from kvstate.lab.prefix.timing import bench_model, measure_engine

torch.set_num_threads(1)  # one thread: less sensitive to other load on a shared 2-core machine


def main() -> None:
    t = measure_engine(bench_model(), n=2048, align=64, slots=8, repeats=7)
    print(f"{'restore at c':>12} {'resume s':>10} {'restore s':>10} {'saved s':>10}")
    for c, tr, tre in zip(t.depths, t.resume_s, t.restore_s, strict=True):
        print(f"{c:>12d} {tr:>10.4f} {tre:>10.5f} {t.resume_s[0] - tr:>10.4f}")
    print(f"full prefill {t.n_tokens} tokens: {t.resume_s[0]:.4f} s; time saved vs tokens saved: R^2 = {t.fit_r2:.4f}")
    print(f"restore overhead / time saved: max {t.restore_overhead_max:.4f}")
    print(f"capture (8 checkpoints + entry snapshot) / plain prefill = {t.capture_ratio:.3f}")
    print(json.dumps({"benchmark": "prefix_engine", **t.as_json()}))


if __name__ == "__main__":
    main()
