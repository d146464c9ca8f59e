"""Why page routing collapses on the real model at 8:1 reads: the ranking signal against the attention oracle.

A dev-seed probe for issue 48 ("Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference", the
routing SEKV shares — ``docs/techniques.md#resolution``). On ``models/smollm2-135m-instruct`` at 2,048 tokens,
Quest-like (:mod:`kvstate.lab.semantic.methods.quest`: 16-token pages, sinks and a 16-token recent window kept)
scores 0.02–0.11 where the full cache scores 0.99 (``models/smollm2/sekv_2048.json``). Two causes are separable:

- **the metadata's share of the read budget**: a page's element-wise min and max keys are two key vectors per
  16 tokens, 1/16 of the full K/V — half of an 8:1 read budget before a page is read;
- **the ranking signal**: Quest's bound ``sum_d max(q_d min_d, q_d max_d)`` against ``q . mean key`` (one key
  vector per page: SentenceKV-like, no guarantee) and the **oracle** — each page's true softmax mass under the
  routing query (the largest over the KV head's query heads), which needs every key and is not a method.

Each ranker runs with the metadata it needs charged to the read budget (``bound``: 2 vectors per page,
``mean``: 1, ``oracle``: charged as the bound) and uncharged (``*_free``: Quest's own token-budget convention),
on one prefill per item shared by every row (:func:`kvstate.lab.experiment.run_items`). Pages are chosen per pass
from the last fed token's queries (the heads' rankings in turn, as the Quest-like baseline), attended at full
precision. Per item and row: the answer's score and the **captured mass** — the share of the routing query's
attention to the paged middle that falls in the pages read, averaged over passes, per layer. Run on dev seeds::

    OMP_NUM_THREADS=1 python -m kvstate.lab.semantic.real_routing --task real_niah_single --n 25 --seed 484 \\
        --out docs/results/smollm2_routing_probe_single.json

Ignored: quantized pages (ranking is what is probed), the first layers kept dense (Quest's practice).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvstate.lab.semantic.methods.quest import PageStore, QuestCache
from kvstate.lab.semantic.methods.window import anchor_logits

EXPERIMENT = "sekv-real-routing"
READS = 0.125
RANKERS = ("bound", "mean", "oracle")
META_VECTORS = {"bound": 2, "mean": 1, "oracle": 2}  # key vectors per page and KV head the ranker keeps
ROWS = ("full", *RANKERS, *(f"{r}_free" for r in RANKERS))


def page_scores(rank: str, q: torch.Tensor, store: PageStore, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per KV head, every page's routing score and its true attention mass: q (H, g, D) → (H, P), (H, g, P).

    The mass is the softmax of ``q`` over the anchors and every middle key, summed per page (the oracle's
    score is its largest over the group's query heads)."""
    h, g, d = q.shape
    n_pages, page, m = store.page_min.shape[1], store.page, store.n_mid
    pad = n_pages * page - m
    qf = q.float()
    logits = torch.cat([qf @ store.anchor_k[0].float().transpose(-1, -2),
                        qf @ store.slow_k.float().transpose(-1, -2)], -1) * scaling
    p = torch.softmax(logits, -1)[..., store.anchor_k.shape[2]:]  # (H, g, M) over the middle
    if pad:
        p = torch.cat([p, p.new_zeros(h, g, pad)], -1)
    mass = p.view(h, g, n_pages, page).sum(-1)
    if rank == "oracle":
        return mass.amax(1), mass
    if rank == "bound":
        lo, hi = store.page_min.float(), store.page_max.float()
        return (qf.clamp_min(0) @ hi.transpose(-1, -2) + qf.clamp_max(0) @ lo.transpose(-1, -2)).amax(1), mass
    if rank == "mean":
        keys = store.slow_k.float()
        if pad:
            keys = torch.cat([keys, keys[:, -1:].expand(-1, pad, -1)], 1)
        return (qf @ keys.view(h, n_pages, page, d).mean(2).transpose(-1, -2)).amax(1), mass
    raise ValueError(f"unknown ranker {rank!r}; choose from {RANKERS}")


@dataclass
class ProbeStore(PageStore):
    """A Quest-like page store ranked by ``rank``, its metadata charged to the read budget or not."""

    rank: str = "bound"
    charged: bool = True
    captured: list[float] = field(default_factory=list)  # per pass: mass of the pages read / mass of the middle
    pages_read: list[int] = field(default_factory=list)  # per pass

    def allowance(self) -> int:
        """Middle tokens the read budget leaves after the anchors (and the ranker's metadata, when charged)."""
        held = self.anchor_k.nbytes + self.anchor_v.nbytes
        if self.charged:
            held += META_VECTORS[self.rank] * self.page_min.nbytes  # page_min: one key vector per page and head
        return max(0, int(self.budget * self.full_nbytes()) - held) // self.token_bytes

    def n_pages_now(self) -> int:
        return len(self._pick(torch.arange(self.page_min.shape[1])[None]))

    def _pick(self, order: torch.Tensor) -> list[int]:
        """Pages from the heads' rankings in turn (rank 0 of every head, then rank 1 ...), as the Quest-like
        baseline, while their tokens (the last page's only what it holds) fit the allowance."""
        left, chosen = self.allowance(), []
        for p in order.T.flatten().tolist():
            if p in chosen:
                continue
            size = min((p + 1) * self.page, self.n_mid) - p * self.page
            if size > left:
                break
            chosen.append(p)
            left -= size
        return chosen

    def attend(self, query: torch.Tensor, scaling: float, *_: Any) -> torch.Tensor:
        q = query[0]
        hq, tq, d = q.shape
        h = self.anchor_k.shape[1]
        g = hq // h
        qg, first = anchor_logits(query, self.anchor_k, scaling)
        score, mass = page_scores(self.rank, q.reshape(h, g, tq, d)[:, :, -1], self, scaling)
        chosen = self._pick(score.argsort(dim=1, descending=True))
        self.pages_read.append(len(chosen))
        total = mass.sum((1, 2))  # (H,)
        got = mass[:, :, chosen].sum((1, 2)) if chosen else torch.zeros_like(total)
        self.captured.append(float((got / total.clamp_min(1e-12)).mean()))
        logits, vals = [first], [self.anchor_v[0]]
        if chosen:
            chosen.sort()
            tok = torch.cat([torch.arange(p * self.page, min((p + 1) * self.page, self.n_mid)) for p in chosen])
            rk, rv = self.read_pages(tok, q.dtype)
            logits.append(qg @ rk.transpose(-1, -2) * scaling)
            vals.append(rv)
        probs = torch.softmax(torch.cat(logits, -1).float(), -1).to(q.dtype)
        return (probs @ torch.cat(vals, 1)).reshape(1, hq, tq, d)


def probe_cache(model: Any, pre_cache: Any, row: str, budget: float = READS) -> QuestCache:
    """A Quest-like cache of the prefilled context whose layers rank pages as ``row`` says."""
    from kvstate.semantic.config import SemanticConfig
    from kvstate.semantic.segment import SegmentConfig

    rank, charged = (row[:-5], False) if row.endswith("_free") else (row, True)
    cache = QuestCache(model, None, SemanticConfig(budget=budget, segment=SegmentConfig(recent=16, max_span=32),
                                                   zoom="none", slow_tier=False))
    cache.adopt(pre_cache)
    cache.compress()
    for layer in cache.semantic_layers:
        s = layer.store
        layer.store = ProbeStore(s.anchor_k, s.anchor_v, s.page_min, s.page_max, s.slow_k, s.slow_v, s.page, s.budget,
                                 rank=rank, charged=charged)
    return cache


def plan(model_dir: Path, task: str, n: int, seed: int, length: int = 2048) -> Any:
    from kvstate.lab.experiment import Experiment

    return Experiment(axis="resolution", name=EXPERIMENT, methods=ROWS, seeds=(seed,), tasks=(task,),
                      lengths=(length,), n=n, reference="full",
                      code=("lab/semantic/real_routing.py", "lab/semantic/methods/quest.py",
                            "lab/semantic/methods/window.py", "lab/semantic/bench.py", "lab/semantic/protocol.py",
                            "lab/workloads/realtext.py", "semantic"),
                      models=(str(model_dir),),
                      settings={"reads": READS, "page": QuestCache.page, "recent": 16, "route_query": "last",
                                "meta_vectors": META_VECTORS, "threads": 1, "dtype": "float32"})


class Measure:
    """Scores every row on one item from one prefill, and keeps each row's captured mass per layer."""

    def __init__(self, model: Any, tokenizer: Any) -> None:
        self.model, self.tok = model, tokenizer

    @torch.no_grad()
    def __call__(self, item: Any) -> Any:
        import copy

        from kvstate.lab.experiment import ItemResult
        from kvstate.lab.semantic import bench
        from kvstate.lab.semantic.protocol import _real_item
        from kvstate.semantic.attention import semantic_attention

        it = _real_item(self.tok, item.task, item.length, item.seed, item.index)
        t0 = time.perf_counter()
        pre = bench.prefill(self.model, it)
        extra: dict[str, Any] = {"depth": it.depth, "answers": it.answers[0], "context_tokens": len(it.context),
                                 "prefill_s": round(time.perf_counter() - t0, 2)}
        scores: dict[str, float] = {}
        ask = (it.questions[0], len(it.context), it.max_new_tokens[0], self.tok.eos_token_id, self.tok)
        for row in ROWS:
            t = time.perf_counter()
            if row == "full":
                pred, _, _ = bench._answer(self.model, copy.deepcopy(pre.cache), *ask)
                extra[row] = {"reply": pred[:200]}
            else:
                cache = probe_cache(self.model, pre.cache, row)
                with semantic_attention(self.model):
                    pred, _, _ = bench._answer(self.model, cache, *ask)
                stores = [layer.store for layer in cache.semantic_layers]
                per_layer = [round(sum(s.captured) / len(s.captured), 4) for s in stores]
                extra[row] = {"reply": pred[:200], "captured_by_layer": per_layer,
                              "captured": round(sum(per_layer) / len(per_layer), 4),
                              "pages_read": [min(stores[0].pages_read), max(stores[0].pages_read)], "pages": int(stores[0].page_min.shape[1])}
            scores[row] = bench.score_prediction(it, 0, pred)
            extra[row]["seconds"] = round(time.perf_counter() - t, 2)
        return ItemResult(scores, extra)


def summary(e: Any, records: Sequence[Any]) -> dict[str, Any]:
    """Per row: mean captured mass (and per layer), pages read of the pages held."""
    out: dict[str, Any] = {}
    for row in ROWS[1:]:
        got = [r["extra"][row] for r in records]
        layers = len(got[0]["captured_by_layer"])
        out[row] = {"captured": round(sum(x["captured"] for x in got) / len(got), 4),
                    "captured_by_layer": [round(sum(x["captured_by_layer"][i] for x in got) / len(got), 4)
                                          for i in range(layers)],
                    "pages_read": [min(x["pages_read"][0] for x in got), max(x["pages_read"][1] for x in got)], "pages": sorted({x["pages"] for x in got})}
    return out


def main(argv: list[str] | None = None) -> int:
    from kvstate.errors import KVStateError
    from kvstate.lab.experiment import check_out, items, run_items
    from kvstate.lab.harness import load_reference
    from kvstate.lab.models.cli import REAL_MODEL
    from kvstate.lab.protocol import is_test_seed

    ap = argparse.ArgumentParser(prog="python -m kvstate.lab.semantic.real_routing",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=REAL_MODEL)
    ap.add_argument("--task", choices=("real_niah_single", "real_niah_multikey"), default="real_niah_single")
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--n", type=int, default=25)
    ap.add_argument("--seed", type=int, required=True, help="a dev seed (< 1000): this is a probe, not a result")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--overwrite", action="store_true")
    a = ap.parse_args(argv)
    try:
        if is_test_seed(a.seed):
            raise KVStateError(f"--seed {a.seed} is a test seed; this probe runs on dev seeds (< 1000), e.g. --seed 484")
        e = plan(a.model, a.task, a.n, a.seed, a.length)
        check_out(e, a.out, overwrite=a.overwrite)
        torch.set_num_threads(1)
        model, tok = load_reference(a.model)
        measure = Measure(model, tok)
        kept: dict[str, Any] = {}

        def fn(item: Any) -> Any:
            got = measure(item)
            kept[item.unit] = {"scores": dict(got.scores), "extra": dict(got.extra)}
            return got

        def appendix(journal: Any) -> dict[str, Any]:
            recs = [journal.get(it.unit) if journal is not None else kept[it.unit] for it in items(e)]
            return {"summary": summary(e, recs)}

        doc = run_items(e, fn, out=a.out, overwrite=a.overwrite,
                        command=" ".join(["python", "-m", "kvstate.lab.semantic.real_routing",
                                          *(argv if argv is not None else sys.argv[1:])]),
                        progress=True, say=lambda m: print(m, file=sys.stderr), appendix=appendix)
    except KVStateError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for r in doc["rows"]:
        print(r, file=sys.stderr)
    for row, s in doc["appendix"]["summary"].items():
        print(f"{row:<14} captured {s['captured']:.3f}  pages read {s['pages_read']} of {s['pages']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
