"""The least memory each SEKV slow tier needs for one context: where 16:1 fits and where it cannot.

For "SEKV: Resolution-Adaptive Semantic KV Cache with Hierarchical Semantic Memory"
(``docs/techniques.md#resolution``). One dev-seed context is prefilled once; for each slow tier
(low-rank, 2- and 4-bit quantized), exact-part sizes (sinks, recent window), longest span and working set
(sticky or not) it compresses at ``budget = memory = --memory`` and records either the bytes held (it fits)
or the minimum the refusal names (``memory >= m``, or ``budget >= m`` when the fast tier alone does not fit
the read budget). Bytes are counted from the tensors; nothing is scored::

    python -m kvstate.lab.semantic.memory_floor --length 4096 --memory 0.0625 --out docs/results/sekv_memory_floor.json
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

import torch

from kvstate.errors import BudgetError
from kvstate.lab.harness import load_reference
from kvstate.lab.provenance import Recorder, append_run
from kvstate.lab.semantic.methods import prefill
from kvstate.lab.semantic.protocol import build_items
from kvstate.semantic import SegmentConfig, SemanticCache, SemanticConfig

TIERS = (("quant", 2), ("quant", 4), ("lowrank", 4))
EXACT = ((16, 4), (8, 4), (0, 1))  # (recent, sinks)
SPANS = (64, 128)


def floors(model: Any, context: list[int], memory: float) -> list[dict[str, Any]]:
    pre = prefill(model, context)
    rows = []
    for slow, bits in TIERS:
        for recent, sinks in EXACT:
            for max_span in SPANS:
                for sticky in (False, True):
                    cfg = SemanticConfig(budget=memory, memory=memory, slow=slow, bits=bits, sticky=sticky,  # type: ignore[arg-type]
                                         outliers=0.0, segment=SegmentConfig(recent=recent, sinks=sinks,
                                                                             max_span=max_span))
                    row: dict[str, Any] = {"slow": slow, "bits": bits if slow == "quant" else None, "recent": recent,
                                           "sinks": sinks, "max_span": max_span, "sticky": sticky}
                    cache = SemanticCache(model, None, cfg)
                    cache.adopt(pre.cache)
                    try:
                        cache.compress(pre.surprisal)
                        b = cache.byte_counts()
                        row |= {"fits": True, "total": round(b.total_bytes / b.full_bytes, 5),
                                "resident": round(b.resident_bytes / b.full_bytes, 5)}
                    except BudgetError as exc:
                        m = re.search(r"(memory|budget) >= (\d+\.\d+)", str(exc))
                        row |= {"fits": False, "minimum": {m.group(1): float(m.group(2))} if m else None,
                                "reason": str(exc)[:300]}
                    rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--model", default="models/ref-attn")
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--memory", type=float, default=0.0625)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    rec = Recorder(code=("semantic", "lab/semantic"), models=[a.model], n=1, seeds=[a.seed], tasks=["niah_single"],
                   lengths=[a.length], settings={"memory": a.memory})
    model, tok = load_reference(a.model)
    rows = floors(model, build_items(tok, "niah_single", a.length, 1, a.seed)[0].context, a.memory)
    for r in rows:
        print({k: v for k, v in r.items() if k != "reason"})
    append_run(a.out, {"rows": rows}, rec.finish())


if __name__ == "__main__":
    main()
