"""Dev timing of the consumer's work per transfer option: what selective recompute costs the consumer against
its own prefill and against DroidSpeak, at one context length, on this machine's CPU.

For the selective recompute of ``kvstate.transfer.recompute`` (``docs/techniques.md#across-models``): the
consumer's milliseconds from the payload's bytes to its first next-token logits (parse, decode or recompute,
first forward) — the oracle's are its prefill of the prompt. No link: the time on the wire is the payload's
bytes over the link's rate, added by the TTFT bench (``kvstate.lab.transfer.ttft``), not here. Median of
``--repeats`` interleaved repeats with min / max. Appends one run with provenance to ``--out``.

Run: ``python -m kvstate.lab.transfer.pilot_options_timing --length 8192 --repeats 5``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

CODE = ("transfer", "lab/transfer/pilot_options_timing.py")


def _time(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - t0)


def main(argv: Sequence[str] | None = None) -> int:
    from kvstate.lab.harness import load_reference
    from kvstate.lab.provenance import Recorder, append_run
    from kvstate.lab.transfer.prompts import calibration_prompts
    from kvstate.transfer import methods as registry
    from kvstate.transfer.calibrate import CalibrationConfig
    from kvstate.transfer.codec import Codec
    from kvstate.transfer.methods.base import MethodContext
    from kvstate.transfer.nonlinear import MapConfig
    from kvstate.transfer.payload import Payload
    from kvstate.transfer.recompute import calibrate_recompute

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--producer", default="models/ref-attn")
    ap.add_argument("--consumer", default="models/ref-attn-ft2")
    ap.add_argument("--codec", default="models/codec-ref-attn-ft2")
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--layer", type=int, default=1, help="the recompute layer (the pilot's profile picked 1)")
    ap.add_argument("--block", default="0:3", help="DroidSpeak's block (the committed bench's profile)")
    ap.add_argument("--out", default="docs/results/transfer_options_timing.json")
    args = ap.parse_args(argv)
    if Path(args.out).resolve().is_relative_to(Path("models").resolve()):
        raise SystemExit("--out: dev timings never go under models/")
    torch.set_num_threads(1)
    rec = Recorder(code=CODE, models=[args.producer, args.consumer, args.codec], n=args.repeats, seeds=[],
                   lengths=[args.length], settings={"dev_timing": True, "threads": 1})
    producer, tok = load_reference(args.producer)
    consumer, _ = load_reference(args.consumer)
    scd = Codec.load(args.codec)
    cal = calibration_prompts(tok, CalibrationConfig(prefixes=24, length=512))
    rc = calibrate_recompute(producer, consumer, scd, cal, rank=64, map_cfg=MapConfig(steps=0), layers=[args.layer])
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, int(consumer.config.vocab_size), (1, args.length), generator=g)
    prompt, t = ids[0].tolist(), args.length - 1
    ctx = MethodContext(scd)
    ds, ds_ctx = registry.get("droidspeak"), ctx.with_options(block=args.block)
    payloads = {"recompute": rc.encode(producer, ids[:, :t]).to_bytes(),
                "droidspeak": ds.encode(producer, ids[:, :t], ds_ctx).to_bytes(),
                "scd": scd.encode(producer, ids[:, :t], check=False).to_bytes()}

    def first(cache: Any) -> None:
        consumer(input_ids=ids[:, t:], position_ids=torch.tensor([[t]]), cache=cache, use_cache=True)

    runs: dict[str, Callable[[], None]] = {
        "oracle": lambda: consumer(input_ids=ids, position_ids=torch.arange(args.length)[None], use_cache=False),
        "recompute": lambda: first(rc.decode(consumer, Payload.from_bytes(payloads["recompute"]), prompt, check=False)),
        "droidspeak": lambda: first(ds.decode(consumer, Payload.from_bytes(payloads["droidspeak"]), prompt, ds_ctx)),
        "scd": lambda: first(scd.decode(consumer, Payload.from_bytes(payloads["scd"]), prompt, check=False)),
    }
    ms: dict[str, list[float]] = {m: [] for m in runs}
    with torch.inference_mode():
        for fn in runs.values():  # warm-up
            fn()
        for r in range(args.repeats):
            for m, fn in runs.items():
                ms[m].append(_time(fn))
            print(f"repeat {r + 1}/{args.repeats}: " + ", ".join(f"{m} {v[-1]:.0f} ms" for m, v in ms.items()),
                  file=sys.stderr, flush=True)
    oracle = statistics.median(ms["oracle"])
    rows = [{"method": m, "consumer_ms": round(statistics.median(v), 1), "spread_ms": [round(min(v), 1), round(max(v), 1)],
             "repeats": len(v), "vs_oracle": round(statistics.median(v) / oracle, 3),
             "payload_bytes_per_token": round(len(payloads[m]) / t, 2) if m in payloads else 0.0} for m, v in ms.items()]
    out = {"length": args.length, "rows": rows, "recompute_modes": rc.modes, "droidspeak_block": args.block,
           "what": "consumer ms from payload bytes to first logits (oracle: its prefill); no link time"}
    append_run(args.out, out, rec.finish())
    for r in rows:
        print(f"{r['method']:12s} {r['consumer_ms']:9.1f} ms {r['spread_ms']} x{r['vs_oracle']:.3f} "
              f"{r['payload_bytes_per_token']} B/tok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
