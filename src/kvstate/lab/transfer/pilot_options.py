"""Dev-seed pilot of the cross-model transfer options: selective recompute, learned nonlinear maps and
cache-conditioned adaptation, alone and combined, against the oracle, raw reuse, REUSE, SCD and DroidSpeak.

For *Semantic Cache Distillation: Efficient State Transfer via Reuse and Selective Patching* on the shifted
pair (``docs/techniques.md#across-models``): every option is fitted on the calibration stream (seed 7919,
prompts ending with their answers) and scored on the solved needle tasks at dev seeds (< 1000) —
design evidence, never a result under ``models/``. Per row: score with its 95% interval, score / oracle,
per task, payload bytes per token (measured from the payloads sent) and recomputed layers (layers whose
attention the consumer runs over the context). Appends one run with provenance to ``--out``.

Run: ``python -m kvstate.lab.transfer.pilot_options --n 12 --seed 5 --out docs/results/transfer_options_pilot.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache

from kvstate.lab.protocol import TEST_SEED_MIN
from kvstate.models.accounting import kv_token_bytes
from kvstate.transfer.adapter import Adapter, AdapterConfig, train_adapter
from kvstate.transfer.codec import Codec
from kvstate.transfer.nonlinear import KVMaps, MapConfig, decode_reuse, train_kv_maps
from kvstate.transfer.payload import Payload
from kvstate.transfer.recompute import RecomputeCodec, calibrate_recompute
from kvstate.transfer.states import build_cache

TASKS = ("niah_single", "niah_multikey")
TARGET_RATIO = 0.94  # quality >= 0.94 x the oracle with <= 1 recomputed layer and <= 1/4 of fp16 raw KV bytes
CODE = ("transfer", "lab/transfer/pilot_options.py", "lab/decode.py", "lab/scoring.py",
        "lab/stats.py", "lab/workloads/tasks.py")

# (name, what it is) in table order
ROWS = (("oracle", "the consumer's own prefill"), ("raw", "producer K/V in fp16"),
        ("reuse", "SCD REUSE codes at every layer (linear decoders)"), ("scd", "SCD at the codec's PATCH layers"),
        ("droidspeak", "DroidSpeak: the profiled block recomputed from the producer's residual stream"),
        ("recompute", "recompute the profiled layer; linear boundary map; REUSE elsewhere"),
        ("nonlinear", "nonlinear maps of the REUSE codes at every layer; nothing recomputed"),
        ("recompute_nonlinear", "recompute + nonlinear boundary map + nonlinear maps elsewhere"),
        ("adapter", "LoRA on the consumer reading the REUSE cache"),
        ("combined", "recompute + nonlinear maps + LoRA reading that cache"))
REFERENCE = ROWS[0][0]  # the first row is every other row's reference: the consumer's own prefill


Make = Callable[[torch.Tensor], tuple[Any, int]]  # prompt ids (1, T) -> (consumer cache of ids[:, :-1], bytes)


def _methods(producer: Any, consumer: Any, scd: Codec, block: tuple[int, int], rc_lin: RecomputeCodec,
             maps: KVMaps, rc_nl: RecomputeCodec) -> dict[str, tuple[Make, int]]:
    """name -> (make the consumer's cache, recomputed layers); the oracle and adapters are handled apart."""
    from kvstate.transfer import methods as registry
    from kvstate.transfer.methods.base import MethodContext

    ctx = MethodContext(scd)

    def wire(pl: Payload) -> tuple[Payload, int]:
        data = pl.to_bytes()
        return Payload.from_bytes(data), len(data)

    def base(method: str, **options: str) -> Make:
        m, c = registry.get(method), ctx.with_options(**options)

        def make(ids: torch.Tensor) -> tuple[Any, int]:
            pl, n = wire(m.encode(producer, ids[:, :-1], c))
            return m.decode(consumer, pl, ids[0].tolist(), c), n
        return make

    def codec(patch: Sequence[int] | None) -> Make:
        def make(ids: torch.Tensor) -> tuple[Any, int]:
            pl, n = wire(scd.encode(producer, ids[:, :-1], patch=patch, check=False))
            return scd.decode(consumer, pl, ids[0].tolist(), check=False), n
        return make

    def rc(c: RecomputeCodec) -> Make:
        def make(ids: torch.Tensor) -> tuple[Any, int]:
            pl, n = wire(c.encode(producer, ids[:, :-1], check=False))
            return c.decode(consumer, pl, ids[0].tolist(), check=False), n
        return make

    def nl(ids: torch.Tensor) -> tuple[Any, int]:
        pl, n = wire(scd.encode(producer, ids[:, :-1], patch=(), check=False))
        return build_cache(consumer, *decode_reuse(maps, scd, consumer, pl, ids[0].tolist())), n

    return {"raw": (base("raw"), 0), "reuse": (codec(()), 0), "scd": (codec(None), 0),
            "droidspeak": (base("droidspeak", block=f"{block[0]}:{block[1]}"), block[1] - block[0]), "recompute": (rc(rc_lin), 1),
            "nonlinear": (nl, 0), "recompute_nonlinear": (rc(rc_nl), 1)}


def run_pilot(producer: Any, consumer: Any, tokenizer: Any, scd: Codec, *, n: int, seed: int, lengths: Sequence[int],
              prefixes: int, rank: int, map_steps: int, map_kl_steps: int, kl_steps: int, adapter_steps: int,
              adapter_lr: float,
              block: tuple[int, int], tick: Callable[[str], None]) -> dict[str, Any]:
    from kvstate.lab import stats
    from kvstate.lab.decode import greedy_decode
    from kvstate.lab.scoring import score
    from kvstate.lab.transfer.prompts import calibration_prompts
    from kvstate.lab.workloads.tasks import generate
    from kvstate.transfer.calibrate import CalibrationConfig

    t0 = time.perf_counter()
    cal = calibration_prompts(tokenizer, CalibrationConfig(prefixes=prefixes, length=512))
    fit = cal[: len(cal) - max(1, len(cal) // 4)]
    rc_lin = calibrate_recompute(producer, consumer, scd, cal, rank=rank, map_cfg=MapConfig(steps=0), progress=tick)
    tick(f"recompute profile {rc_lin.info['kl_by_layer']} -> layer {rc_lin.config.layer}")
    maps = train_kv_maps(producer, consumer, scd, fit, range(scd.geometry.n_layers),
                         MapConfig(steps=map_steps, kl_steps=map_kl_steps), tick)
    rc_nl = calibrate_recompute(producer, consumer, scd, cal, rank=rank,
                                map_cfg=MapConfig(steps=map_steps, kl_steps=kl_steps), maps=maps, progress=tick)
    tick(f"recompute + nonlinear profile {rc_nl.info['kl_by_layer']} -> layer {rc_nl.config.layer}")
    acfg = AdapterConfig(steps=adapter_steps, lr=adapter_lr)
    ad_reuse = train_adapter(scd.producer_fp, consumer, scd.pair.hex(), lambda ids: scd.decode_layers(
        consumer, scd.encode(producer, ids, patch=(), check=False), check=False), fit, acfg, tick)
    ad_comb = train_adapter(scd.producer_fp, consumer, rc_nl.pair.hex(), lambda ids: rc_nl.decode_layers(
        consumer, rc_nl.encode(producer, ids, check=False), ids[0].tolist(), check=False), fit, acfg, tick)
    fit_s = time.perf_counter() - t0
    methods = _methods(producer, consumer, scd, block, rc_lin, maps, rc_nl)
    adapters: dict[str, tuple[str, Adapter]] = {"adapter": ("reuse", ad_reuse), "combined": ("recompute_nonlinear", ad_comb)}
    items: dict[tuple[str, int], dict[str, list[float]]] = {}
    nbytes: dict[str, list[int]] = {m: [] for m, _ in ROWS}
    ntok: dict[str, list[int]] = {m: [] for m, _ in ROWS}
    eos = tokenizer.eos_token_id
    for length in lengths:
        for task in TASKS:
            for ex in generate(task, length, n, seed, tokenizer):
                ids = torch.tensor([tokenizer(ex.prompt)["input_ids"]], dtype=torch.long)
                budget = len(tokenizer(ex.target, add_special_tokens=False)["input_ids"]) + 8
                start = ids.shape[1] - 1
                for m, _ in ROWS:
                    if m == REFERENCE:
                        cache, b, s = DynamicCache(config=consumer.config), 0, 0
                    else:
                        src, ad = adapters.get(m, (m, None))
                        cache, b = methods[src][0](ids)
                        s = start
                    ad = adapters[m][1] if m in adapters else None
                    if ad is not None:
                        with ad.applied(consumer):
                            r = greedy_decode(consumer, cache, s, budget, eos, input_ids=ids[0, s:])
                    else:
                        r = greedy_decode(consumer, cache, s, budget, eos, input_ids=ids[0, s:])
                    items.setdefault((m, length), {}).setdefault(task, []).append(
                        score(ex, tokenizer.decode(r.tokens, skip_special_tokens=True)))
                    nbytes[m].append(b)
                    ntok[m].append(start)
                tick(f"{task}@{length}")
    fp16 = kv_token_bytes(scd.geometry.n_kv_heads, scd.geometry.head_dim, 2, scd.geometry.n_layers)
    recomputed = {m: (methods[adapters[m][0]][1] if m in adapters else methods[m][1] if m in methods else 4)
                  for m, _ in ROWS}
    recomputed[REFERENCE] = scd.geometry.n_layers
    table: list[dict[str, Any]] = []
    for length in [*lengths, 0]:
        ref: list[float] = []
        for m, what in ROWS:
            cells = {task: [x for L in lengths if length in (0, L) for x in items[(m, L)][task]] for task in TASKS}
            pooled = [x for task in TASKS for x in cells[task]]
            if m == REFERENCE:
                ref = pooled
            est = stats.rate(pooled, seed=seed)
            d = stats.paired_difference(pooled, ref, seed=seed) if m != REFERENCE else None
            row: dict[str, Any] = {
                "method": m, "what": what, "length": length or "pooled", "n": len(pooled),
                "score": round(est.value, 4), "score_ci": [round(est.lo, 4), round(est.hi, 4)],
                "vs_oracle": round(est.value / max(1e-9, sum(ref) / len(ref)), 4),
                "diff_vs_oracle_ci": None if d is None else [round(d.lo, 4), round(d.hi, 4)],
                "by_task": {t: round(sum(v) / len(v), 4) for t, v in cells.items()},
                "payload_bytes_per_token": round(sum(nbytes[m]) / sum(ntok[m]), 2),
                "recomputed_layers": recomputed[m]}
            # the corner, as a dev point estimate (decided on test seeds, not here)
            row["dev_corner"] = (m != REFERENCE and row["vs_oracle"] >= TARGET_RATIO and row["recomputed_layers"] <= 1
                                 and row["payload_bytes_per_token"] <= fp16 / 4)
            table.append(row)
    return {"table": table, "fp16_raw_kv_bytes_per_token": fp16, "droidspeak_block": list(block),
            "recompute_profile": {"linear": rc_lin.info["kl_by_layer"], "nonlinear": rc_nl.info["kl_by_layer"]},
            "recompute_layer": {"linear": rc_lin.config.layer, "nonlinear": rc_nl.config.layer},
            "modes": {"recompute": rc_lin.modes, "recompute_nonlinear": rc_nl.modes},
            "settings": {"rank": rank, "map_steps": map_steps, "map_kl_steps": map_kl_steps, "kl_steps": kl_steps, "adapter": asdict(acfg),
                         "calibration_prefixes": prefixes, "calibration_length": 512, "calibration_seed": 7919},
            "fit_seconds": round(fit_s, 1)}


def main(argv: Sequence[str] | None = None) -> int:
    from kvstate.lab.harness import load_reference
    from kvstate.lab.provenance import Recorder, append_run

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--producer", default="models/ref-attn")
    ap.add_argument("--consumer", default="models/ref-attn-ft2")
    ap.add_argument("--codec", default="models/codec-ref-attn-ft2")
    ap.add_argument("--n", type=int, default=12, help="items per task and length")
    ap.add_argument("--seed", type=int, default=5, help=f"dev seed (< {TEST_SEED_MIN})")
    ap.add_argument("--lengths", default="1024,2048")
    ap.add_argument("--prefixes", type=int, default=48, help="calibration prefixes (a quarter held out)")
    ap.add_argument("--rank", type=int, default=64, help="boundary code channels")
    ap.add_argument("--map-steps", type=int, default=400)
    ap.add_argument("--kl-steps", type=int, default=100, help="KL fine-tuning steps of the boundary map")
    ap.add_argument("--map-kl-steps", type=int, default=300, help="KL fine-tuning steps of the REUSE-code maps")
    ap.add_argument("--adapter-steps", type=int, default=800)
    ap.add_argument("--adapter-lr", type=float, default=2e-3)
    ap.add_argument("--block", default="0,3", help="DroidSpeak's block a,b (the committed bench's profile: 0,3)")
    ap.add_argument("--out", default="docs/results/transfer_options_pilot.json")
    args = ap.parse_args(argv)
    if not 0 <= args.seed < TEST_SEED_MIN:
        raise SystemExit(f"--seed {args.seed}: the pilot takes dev seeds only (< {TEST_SEED_MIN})")
    if Path(args.out).resolve().is_relative_to(Path("models").resolve()):
        raise SystemExit("--out: dev-seed results never go under models/")
    torch.set_num_threads(1)
    lengths = [int(x) for x in args.lengths.split(",")]
    a, b = (int(x) for x in args.block.split(","))
    rec = Recorder(code=CODE, models=[args.producer, args.consumer, args.codec], n=args.n, seeds=[args.seed],
                   tasks=TASKS, lengths=lengths, settings={"dev_pilot": True})
    producer, tok = load_reference(args.producer)
    consumer, _ = load_reference(args.consumer)
    scd = Codec.load(args.codec)

    def tick(s: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {s}", file=sys.stderr, flush=True)

    out = run_pilot(producer, consumer, tok, scd, n=args.n, seed=args.seed, lengths=lengths, prefixes=args.prefixes,
                    rank=args.rank, map_steps=args.map_steps, map_kl_steps=args.map_kl_steps, kl_steps=args.kl_steps,
                    adapter_steps=args.adapter_steps, adapter_lr=args.adapter_lr, block=(a, b), tick=tick)
    append_run(args.out, out, rec.finish())
    for r in out["table"]:
        print(f"{r['method']:20s} {r['length']!s:7s} {r['score']:.3f} {r['score_ci']} x{r['vs_oracle']:.2f} "
              f"{r['payload_bytes_per_token']:8.1f} B/tok rec {r['recomputed_layers']} {r['by_task']}"
              f"{' corner' if r['dev_corner'] else ''}")
    print(json.dumps({k: v for k, v in out.items() if k != "table"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
