"""Benchmark: per-request bookkeeping of the radix prefix store (pure; no model, fake payloads).

The store holds E entries of L tokens that share only a BOS token (the worst case for the old per-entry
histograms: every request overlapped every entry). Each timed request is one transaction — ``begin``
(match, record, plan on the request's path, or with ``placement="tree"`` re-plan its bounded subtree
when it drifted) and ``commit`` (insert, charge, evict under the budget) —
for a new document, or for a new question on a stored document. Prints a table, then one JSON line.
"""

from __future__ import annotations

import json
import statistics
import time

import numpy as np

from kvstate.prefix.placement import plan_checkpoints
from kvstate.prefix.store import PrefixStore, StoreConfig
from kvstate.prefix.tree_placement import PrefixTree, plan_tree
from kvstate.prefix.tree_plan import TreeLimits

ALIGN, SLOTS = 64, 8


def _store(budget: int, placement: str = "path") -> PrefixStore:
    def plan(w: np.ndarray, n: int) -> list[int]:
        return [] if n <= ALIGN else plan_checkpoints(w, SLOTS, "optimal", ALIGN)

    cfg = StoreConfig(
        budget, SLOTS, checkpoint_bytes=1000, kv_bytes_per_token=1, logits_bytes=10, placement=placement, align=ALIGN
    )
    return PrefixStore(cfg, plan, splitter=lambda kv, k: (None, None))


def _serve(store: PrefixStore, tokens: tuple[int, ...]) -> None:
    txn = store.begin(tokens)
    if txn.hit.full:
        store.commit(txn, {}, None)  # a full hit is learned from and counted, as the engine does
        return
    store.commit(txn, dict.fromkeys(txn.capture), lambda a, b: None, None)


def run(entries: int, length: int, requests: int, seed: int = 0, placement: str = "path") -> dict[str, float]:
    rng = np.random.default_rng(seed)
    docs = [(1, *map(int, rng.integers(2, 50_000, length - 1))) for _ in range(entries)]
    store = _store(budget=10**15, placement=placement)
    for d in docs:
        _serve(store, d)
    new_doc, question = [], []
    for _ in range(requests):
        fresh = (1, *map(int, rng.integers(2, 50_000, length - 1)))
        t0 = time.perf_counter()
        _serve(store, fresh)
        new_doc.append(time.perf_counter() - t0)
        d = docs[int(rng.integers(entries))]
        q = (*d[: length - 32], *map(int, rng.integers(2, 50_000, 40)))
        t0 = time.perf_counter()
        _serve(store, q)
        question.append(time.perf_counter() - t0)
    return {
        "placement": placement,
        "entries": entries,
        "tokens_per_entry": length,
        "new_document_ms": 1e3 * statistics.median(new_doc),
        "question_ms": 1e3 * statistics.median(question),
        "nodes": len(store.nodes()),
    }


def replan_at_caps(shape: str, seed: int = 0) -> dict[str, float]:
    """One exact tree re-plan at the default caps of tree placement (the worst case a request can pay):
    34 nodes (32 plus the request's cut and new part), 32 slots, 64 grid points over ~4K tokens."""
    rng = np.random.default_rng(seed)
    lim = TreeLimits()
    n = lim.max_nodes + 2
    parent, edge, mass = [-1], [0], [np.zeros(0)]
    for v in range(1, n):
        parent.append(v - 1 if shape == "chain" else min(v - 1, 1))
        length = 4096 // n if shape == "chain" else (3500 if v == 1 else 500)
        edge.append(length)
        mass.append(rng.random(length))
    tree = PrefixTree(tuple(parent), tuple(edge), tuple(mass), root_mass=1.0)
    deepest = max(tree.end(v) for v in range(tree.size))
    align = ALIGN * max(1, -(-deepest // (ALIGN * lim.max_grid)))
    t0 = time.perf_counter()
    plan_tree(tree, lim.max_slots, align)
    return {"shape": shape, "nodes": n, "slots": lim.max_slots, "replan_ms": 1e3 * (time.perf_counter() - t0)}


def main() -> None:
    rows = [run(e, 4096, 20, placement=p) for p in ("path", "tree") for e in (100, 1000)]
    print(f"{'placement':>9} {'entries':>8} {'tokens':>7} {'new doc ms':>11} {'question ms':>12} {'nodes':>7}")
    for r in rows:
        print(
            f"{r['placement']:>9} {r['entries']:>8} {r['tokens_per_entry']:>7} {r['new_document_ms']:>11.2f} "
            f"{r['question_ms']:>12.2f} {r['nodes']:>7}"
        )
    caps = [replan_at_caps(shape) for shape in ("chain", "star")]
    for c in caps:
        print(f"tree re-plan at the caps ({c['shape']}, {c['nodes']} nodes, {c['slots']} slots): {c['replan_ms']:.1f} ms")
    print(json.dumps({"benchmark": "prefix_store", "rows": rows, "replan_at_caps": caps, "target_ms": 5.0}))


if __name__ == "__main__":
    main()
