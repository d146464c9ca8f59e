"""A dev-seed probe of where SCD's PATCH costs retrieval: one layer's state replaced, and the PATCH budget.

For *Semantic Cache Distillation: Efficient State Transfer via Reuse and Selective Patching*
(``docs/techniques.md#across-models``). On niah_multikey and niah_single items at one length, dev seeds
only (tuning, never reported as a result), it scores the consumer's greedy answer when

- **one layer** holds a replaced state and every other layer the consumer's own K/V: the producer's raw
  K/V, the codec's REUSE decode, or its PATCH decode (one codec per ``--patch-map``); the oracle holds
  the consumer's own K/V everywhere;
- **the PATCH budget** k = 0..L: the codec's k layers of largest calibrated gain PATCHed, REUSE elsewhere
  (``scd_k`` of ``kvstate transfer bench``);
- **REUSE maps** (``--reuse-map regress,pca``): other REUSE maps alone at one layer and at every layer, with
  their calibration's average K/V error and next-token KL (a map fit for average error can win those and
  still lose retrieval).

Prints one table per part and one JSON line. Usage: ``python -m kvstate.lab.transfer.patch_probe
[--producer models/ref-attn] [--consumer models/ref-attn-ft] [--n 16] [--seed 2] [--patch-map regress,joint]
[--reuse-map regress,pca]``.
Ignored: perplexity and the other tasks (the bench measures those).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

import torch

from kvstate.errors import KVStateError
from kvstate.lab.decode import greedy_decode
from kvstate.lab.protocol import TEST_SEED_MIN
from kvstate.lab.scoring import score
from kvstate.transfer.calibrate import PATCH_MAPS, REUSE_MAPS, CalibrationConfig, calibrate_on
from kvstate.transfer.codec import Codec
from kvstate.transfer.methods.scd import budget_layers
from kvstate.transfer.states import build_cache, prefill_states

TASKS = ("niah_multikey", "niah_single")


def _answer(consumer: Any, tokenizer: Any, ex: Any, ids: torch.Tensor, keys: list[torch.Tensor],
            values: list[torch.Tensor]) -> float:
    t = ids.shape[1] - 1
    budget = len(tokenizer(ex.target, add_special_tokens=False)["input_ids"]) + 8
    r = greedy_decode(consumer, build_cache(consumer, keys, values), t, budget, tokenizer.eos_token_id,
                      input_ids=ids[0, t:])
    return score(ex, tokenizer.decode(r.tokens, skip_special_tokens=True))


@torch.inference_mode()
def run_probe(producer: Any, consumer: Any, tokenizer: Any, codecs: dict[str, Codec], n: int, seed: int,
              length: int, reuse_codecs: dict[str, Codec] | None = None) -> dict[str, Any]:
    """``{"layer": {variant: {task: score}}, "budget": {patch_map: [{k, layers, task: score}]}, "reuse":
    {reuse_map: {task: score}}}``: ``codecs`` by PATCH map; ``reuse_codecs`` by REUSE map (their REUSE alone at
    one layer and at every layer)."""
    reuse_codecs = reuse_codecs or {}
    from kvstate.lab.workloads.tasks import generate

    if seed >= TEST_SEED_MIN:
        raise KVStateError(f"--seed {seed} is a test seed; this probe is for tuning: pass a dev seed < {TEST_SEED_MIN}")
    n_layers = next(iter(codecs.values())).geometry.n_layers
    layer: dict[str, dict[str, list[float]]] = {}
    budget: dict[str, dict[int, dict[str, list[float]]]] = {m: {} for m in codecs}
    reuse: dict[str, dict[str, list[float]]] = {}
    for task in TASKS:
        for ex in generate(task, length, n, seed, tokenizer):
            ids = torch.tensor([tokenizer(ex.prompt)["input_ids"]], dtype=torch.long)
            pre = ids[:, :-1]
            ps, cs = prefill_states(producer, pre), prefill_states(consumer, pre)
            first = next(iter(codecs.values()))  # the PATCH map does not change the REUSE maps: one REUSE variant
            repl = {"raw": (ps.k, ps.v), "reuse": first.decode_layers(
                consumer, first.encode(producer, pre, patch=(), check=False), check=False)}
            for m, c in reuse_codecs.items():
                repl[f"reuse ({m})"] = c.decode_layers(consumer, c.encode(producer, pre, patch=(), check=False),
                                                       check=False)
                reuse.setdefault(m, {}).setdefault(task, []).append(_answer(consumer, tokenizer, ex, ids,
                                                                            *repl[f"reuse ({m})"]))
            for m, c in codecs.items():
                repl[f"patch ({m})"] = c.decode_layers(consumer, c.encode(producer, pre, patch=range(n_layers),
                                                                          check=False), check=False)
            layer.setdefault("oracle", {}).setdefault(task, []).append(_answer(consumer, tokenizer, ex, ids, cs.k, cs.v))
            for name, (k, v) in repl.items():
                for i in range(n_layers):
                    keys = [k[j] if j == i else cs.k[j] for j in range(n_layers)]
                    vals = [v[j] if j == i else cs.v[j] for j in range(n_layers)]
                    layer.setdefault(f"{name} at layer {i}", {}).setdefault(task, []).append(
                        _answer(consumer, tokenizer, ex, ids, keys, vals))
            for m, c in codecs.items():
                for kk in range(n_layers + 1):
                    kv = c.decode_layers(consumer, c.encode(producer, pre, patch=budget_layers(c, kk), check=False),
                                         check=False)
                    budget[m].setdefault(kk, {}).setdefault(task, []).append(_answer(consumer, tokenizer, ex, ids, *kv))
    mean = lambda xs: round(sum(xs) / len(xs), 4)  # noqa: E731
    return {"n": n, "seed": seed, "length": length,
            "layer": {name: {t: mean(s) for t, s in cells.items()} for name, cells in layer.items()},
            "budget": {m: [{"k": kk, "layers": budget_layers(codecs[m], kk), **{t: mean(s) for t, s in cells.items()}}
                           for kk, cells in rows.items()] for m, rows in budget.items()},
            "reuse": {m: {t: mean(sc) for t, sc in cells.items()} for m, cells in reuse.items()},
            "patch_gain": {m: c.info.get("patch_gain") for m, c in codecs.items()},
            "calibration": {name: {"reuse_err_k": _avg(c.info.get("reuse_err_k")), "reuse_err_v": _avg(
                c.info.get("reuse_err_v")), "kl_all_layers": c.info.get("kl_all_layers")}
                for name, c in [*codecs.items(), *(("reuse " + m, c) for m, c in reuse_codecs.items())]}}


def _avg(xs: Sequence[float] | None) -> float | None:
    return round(sum(xs) / len(xs), 4) if xs else None


def main(argv: Sequence[str] | None = None) -> int:
    from kvstate.lab.harness import load_reference
    from kvstate.lab.transfer.prompts import calibration_prompts

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--producer", default="models/ref-attn")
    ap.add_argument("--consumer", default="models/ref-attn-ft")
    ap.add_argument("--n", type=int, default=16, help="items per task")
    ap.add_argument("--seed", type=int, default=2, help=f"dev seed (< {TEST_SEED_MIN})")
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--prefixes", type=int, default=16, help="calibration prefixes of each codec")
    ap.add_argument("--patch-map", default="regress,joint", help=f"codecs to calibrate, of {PATCH_MAPS}")
    ap.add_argument("--reuse-map", default="", help=f"REUSE maps to compare alone, of {REUSE_MAPS} (e.g. regress,pca)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    producer, tok = load_reference(args.producer)
    consumer, _ = load_reference(args.consumer)
    codecs = {}
    for m in args.patch_map.split(","):
        cfg = CalibrationConfig(rank_k=16, rank_v=32, rank_h=64, prefixes=args.prefixes, patch_map=m)
        codecs[m] = calibrate_on(producer, consumer, calibration_prompts(tok, cfg), cfg)
    reuse_codecs = {}
    for m in filter(None, args.reuse_map.split(",")):
        cfg = CalibrationConfig(rank_k=16, rank_v=32, rank_h=64, prefixes=args.prefixes, reuse_map=m, aligner_steps=0)
        reuse_codecs[m] = calibrate_on(producer, consumer, calibration_prompts(tok, cfg), cfg)
    out = run_probe(producer, consumer, tok, codecs, args.n, args.seed, args.length, reuse_codecs)
    for name, cells in out["layer"].items():
        print(f"{name:28s} " + "  ".join(f"{t} {s:.3f}" for t, s in cells.items()), file=sys.stderr)
    for m, cells in out["reuse"].items():
        print(f"reuse ({m}) at every layer: " + "  ".join(f"{t} {sc:.3f}" for t, sc in cells.items()), file=sys.stderr)
    for name, cal in out["calibration"].items():
        print(f"calibration {name}: {cal}", file=sys.stderr)
    for m, rows in out["budget"].items():
        for r in rows:
            print(f"budget ({m}) k={r['k']} {r['layers']}: " + "  ".join(f"{t} {r[t]:.3f}" for t in TASKS),
                  file=sys.stderr)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
