"""Why SEKV misses the needle: where its learned routing ranks the needle's span, against key bounds.

A dev-seed probe for "SEKV: Resolution-Adaptive Semantic KV Cache with Hierarchical Semantic Memory"
(``docs/techniques.md#resolution``). For each ``niah_single`` item it compresses the context as the bench's
``sekv`` method does, feeds the question once, and records, at every attention layer of that pass, the
spans the router scored and the ones the budget let it expand. The needle's span(s) — those holding a
token of the asked value — are then ranked three ways over the same spans and the same last-token query:
the shipped routing's score (``--routing bounds``: the bound over the keys the slow tier gives back;
``learned``: the paper's learned relevance), the Quest bound ``sum_d max(q_d min_d, q_d max_d)`` of each span's
raw keys (what the Quest-like baseline uses over pages), the exact largest logit ``max_k q . k`` of each span's raw
keys (``max_logit``: the oracle the bound stands in for), ``q . mean key`` (SentenceKV-like) and, for a low-rank
slow tier, the bound in the rank-r coordinates of each span's key factors (``rank_coords``). Printed per
layer: how often the needle was in an anchor, how often a needle span was expanded, and its median rank
and top-2 / top-``--top`` hit rates under each score; over items, the share whose needle span ranked in the
top ``--top`` under the shipped routing at *every* layer (``top8_every_layer``), and the share of all items
whose needle was either an anchor or so ranked (``top8_items``). Run on dev seeds only::

    python -m kvstate.lab.semantic.route_probe --model models/ref-attn --router models/ref-attn-sekv \\
        --length 2048 --budget 0.125 --n 20 --seed 2
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvstate.lab.harness import load_reference
from kvstate.lab.protocol import DEV_SEEDS
from kvstate.lab.provenance import Recorder, append_run
from kvstate.lab.semantic.bench import compressed_cache, prefill
from kvstate.lab.semantic.protocol import build_items
from kvstate.semantic import SegmentConfig, SemanticConfig, SemanticRouter, semantic_attention
from kvstate.semantic.bounds import rank_bounds, rank_upper_bound
from kvstate.semantic.lowrank import LowRank
from kvstate.semantic.store import SpanStore

TOP = 8  # the routing target: the needle's span among the first 8 spans


def _needle(item: Any, tokenizer: Any) -> set[int]:
    """Context positions of the asked value's tokens (its last occurrence: the needle)."""
    ans = list(tokenizer(" " + item.answers[0][0], add_special_tokens=False)["input_ids"])
    ctx = item.context
    hits = [i for i in range(len(ctx) - len(ans) + 1) if ctx[i:i + len(ans)] == ans]
    return set(range(hits[-1], hits[-1] + len(ans))) if hits else set()


def _ranks(score: torch.Tensor, targets: list[int]) -> int:
    """Best (0-based) rank among ``targets`` of a (S,) score, higher first."""
    order = torch.argsort(score, descending=True).tolist()
    return min(order.index(t) for t in targets)


def probe(model_dir: str, router_dir: str, length: int, budget: float, n: int, seed: int,
          recent: int = 16, max_span: int = 32, routing: str = "bounds", slow: str = "lowrank", bits: int = 4,
          memory: float | None = None, top: int = TOP, expand_share: float = 0.5,
          summaries: bool = False) -> dict[str, Any]:
    model, tokenizer = load_reference(model_dir)
    model.eval()
    router = SemanticRouter.load(router_dir, model)
    segment = SegmentConfig(recent=recent, max_span=max_span)
    items = build_items(tokenizer, "niah_single", length, n, seed)
    calls: list[dict[str, Any]] = []
    decide, select = SpanStore.decide, SpanStore.select

    def rec_decide(self: SpanStore, query: torch.Tensor, scaling: float, router: Any, layer: int, config: Any) -> Any:
        want, score = decide(self, query, scaling, router, layer, config)
        calls.append({"layer": layer, "store": self, "query": query, "scaling": scaling, "score": score})
        return want, score

    def rec_select(self: SpanStore, want: torch.Tensor, score: torch.Tensor, allowance: int | None) -> torch.Tensor:
        chosen = select(self, want, score, allowance)
        calls[-1]["chosen"] = chosen
        return chosen

    per: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    every: list[float] = []  # per item whose needle fell in a span: 1 if it ranked in the top ``top`` at every layer
    kept = 0  # items whose needle is an anchor (kept exact, nothing to route)
    pointed: list[float] = []  # per (item, layer) whose exact max logit ranks the needle's span in the top: shipped hit
    SpanStore.decide, SpanStore.select = rec_decide, rec_select  # type: ignore[method-assign]
    try:
        for it in items:
            pre = prefill(model, it)
            raw = {i: layer.keys for i, layer in enumerate(pre.cache.layers) if getattr(layer, "keys", None) is not None}
            cache = compressed_cache("sekv", model, tokenizer, it, budget, router, segment, prefilled=pre,
                                     config=SemanticConfig(budget=budget, segment=segment, routing=routing,
                                                                 slow=slow, bits=bits, memory=memory,
                                                                 expand_share=expand_share,
                                                                 summaries=summaries))  # type: ignore[arg-type]
            needle = _needle(it, tokenizer)
            seg = cache.segmentation
            spans = [(int(a), int(b)) for a, b in seg.spans]
            target = [s for s, (a, b) in enumerate(spans) if needle & set(range(a, b))]
            anchored = bool(needle) and needle <= {int(a) for a in seg.anchors}
            calls.clear()
            work = cache.fork()
            q = torch.tensor([it.questions[0]])
            t0 = len(it.context)
            with torch.no_grad(), semantic_attention(model):
                model(input_ids=q, position_ids=torch.arange(t0, t0 + q.shape[1])[None], cache=work, use_cache=True)
            hits: list[bool] = []
            for c in calls:
                L, st = c["layer"], c["store"]
                stats = per[L]
                stats["anchored"].append(float(anchored))
                if not target or st.n_spans != len(spans):
                    continue
                keys = raw[L][0]  # (H, T, D) post-rotary keys of the context
                h, d = keys.shape[0], keys.shape[2]
                qg = c["query"].reshape(h, -1, d).float()  # (H, g, D) the last token's query per KV head
                lo = torch.stack([keys[:, a:b].amin(1) for a, b in spans], 1).float()  # (H, S, D)
                hi = torch.stack([keys[:, a:b].amax(1) for a, b in spans], 1).float()
                bound = torch.maximum(qg[:, :, None, :] * lo[:, None], qg[:, :, None, :] * hi[:, None]).sum(-1)
                mean = torch.stack([keys[:, a:b].mean(1) for a, b in spans], 1).float()
                sim = torch.einsum("hgd,hsd->hgs", qg, mean)
                # the exact largest logit of each span's raw keys: the ranking the bound stands in for (an oracle:
                # where the needle's span ranks low here, the layer's query does not point at the needle at all)
                best = torch.stack([torch.einsum("hgd,hnd->hgn", qg, keys[:, a:b].float()).amax(-1) for a, b in spans],
                                   -1)  # (H, g, S)
                scores = {f"shipped_{routing}": c["score"].amax(0), "bounds": bound.amax(1).amax(0),
                          "max_logit": best.amax(1).amax(0), "mean_key": sim.amax(1).amax(0)}
                if all(isinstance(e[0], LowRank) for e in st.slow[:len(spans)]):  # the bound in rank-r coordinates
                    scores["rank_coords"] = torch.stack([rank_upper_bound(qg, e[0].b, *rank_bounds(e[0].a)).amax()
                                                         for e in st.slow[:len(spans)]])
                stats["expanded"].append(float(bool(c["chosen"][target].any())))
                stats["n_chosen"].append(float(c["chosen"].sum()))
                stats["n_spans"].append(float(len(spans)))
                oracle_top = _ranks(scores["max_logit"], target) < top
                shipped_top = _ranks(scores[f"shipped_{routing}"], target) < top
                if oracle_top:  # a layer whose query points at the needle: does the shipped routing find it too?
                    pointed.append(float(shipped_top))
                for name, s in scores.items():
                    r = _ranks(s, target)
                    stats[f"rank_{name}"].append(float(r))
                    stats[f"top2_{name}"].append(float(r < 2))
                    stats[f"top{top}_{name}"].append(float(r < top))
                    if name == f"shipped_{routing}":
                        hits.append(r < top)
            if hits:
                every.append(float(all(hits)))
            elif anchored:
                kept += 1
    finally:
        SpanStore.decide, SpanStore.select = decide, select  # type: ignore[method-assign]
    layers = {L: {k: round(float(np.median(v)) if k.startswith(("rank_", "n_")) else float(np.mean(v)), 3)
                  for k, v in s.items() if v} for L, s in sorted(per.items())}  # ranks / counts: medians; rates: means
    return {"model": model_dir, "router": router_dir, "routing": routing, "length": length, "budget": budget,
            "n": n, "seed": seed, "recent": recent, "max_span": max_span, "slow": slow, "bits": bits, "memory": memory,
            "top": top, "expand_share": expand_share, "summaries": summaries, "in_span": len(every), "anchored": kept,
            f"top{top}_every_layer": round(float(np.mean(every)), 4) if every else None,
            f"top{top}_items": round((sum(every) + kept) / max(len(every) + kept, 1), 4),
            # over (item, layer) pairs whose query points at the needle (its span in the top by the exact max logit):
            # the share the shipped routing ranks in the top too, with its Wilson interval
            f"top{top}_where_exact": _share(pointed),
            "layers": layers}


def _share(hits: list[float]) -> dict[str, Any] | None:
    if not hits:
        return None
    from kvstate.lab.stats import wilson

    e = wilson(int(sum(hits)), len(hits))
    return {"value": round(e.value, 4), "ci": [round(e.lo, 4), round(e.hi, 4)], "n": e.n}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/ref-attn")
    ap.add_argument("--router", default="models/ref-attn-sekv")
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--budget", type=float, default=0.125)
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--seed", type=int, default=DEV_SEEDS[0])
    ap.add_argument("--routing", choices=("bounds", "learned"), default="bounds")
    ap.add_argument("--recent", type=int, default=16)
    ap.add_argument("--max-span", type=int, default=32)
    ap.add_argument("--slow", choices=("lowrank", "quant", "raw"), default="lowrank")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--memory", type=float, default=None)
    ap.add_argument("--top", type=int, default=TOP)
    ap.add_argument("--expand-share", type=float, default=0.5)
    ap.add_argument("--summaries", action="store_true", help="attend unexpanded spans as summaries (learned: always)")
    ap.add_argument("--out", type=Path, default=None, help="append the result, with its provenance, to this file")
    a = ap.parse_args(argv)
    if a.seed not in DEV_SEEDS:
        sys.exit(f"--seed {a.seed}: this probe tunes nothing but reads items; use a dev seed {list(DEV_SEEDS)}")
    torch.set_num_threads(1)
    code = ("semantic", "models", "lab/semantic/route_probe.py", "lab/semantic/bench.py", "lab/semantic/protocol.py",
            "lab/semantic/methods", "lab/harness.py", "lab/decode.py")  # what it runs (not the report's section)
    rec = Recorder(code=code, models=[a.model, a.router], n=a.n, seeds=[a.seed],
                   tasks=["niah_single"], lengths=[a.length],
                   settings={k: getattr(a, k) for k in ("budget", "routing", "recent", "max_span", "slow", "bits",
                                                        "memory", "top", "expand_share", "summaries")})
    res = probe(a.model, a.router, a.length, a.budget, a.n, a.seed, recent=a.recent, max_span=a.max_span,
                routing=a.routing, slow=a.slow, bits=a.bits, memory=a.memory, top=a.top, expand_share=a.expand_share,
                summaries=a.summaries or a.routing == "learned")
    for L, row in res["layers"].items():
        print(f"layer {L}: " + ", ".join(f"{k} {v}" for k, v in row.items()), file=sys.stderr)
    print(json.dumps(res))
    if a.out is not None:
        append_run(a.out, res, rec.finish())


if __name__ == "__main__":
    main()
