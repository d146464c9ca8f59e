"""Benchmark: a chat trace replayed through `kvstate serve` on models/ref-hybrid, cache on vs cache off (TTFT).

Starts two servers (one thread each, loopback, free ports): the prefix cache on, and `--no-cache`. Each
repeat replays a fresh chat trace (seed = repeat; `kvstate.lab.workloads.traces.generate("chat", ...)`,
lengths scaled by `--scale`) through both with :func:`kvstate.lab.prefix.replay_server.replay_server`:
every request goes to both servers, the order alternating, as a streaming `/v1/completions` call of its
token ids with `max_tokens=1`, timed to the first streamed chunk. Fresh content per repeat keeps the
repeats alike (the cached server keeps what earlier repeats stored, but none of it is shared). Reports
the median over repeats of each repeat's median TTFT, and the spread of the per-repeat ratio.

Usage: ``OMP_NUM_THREADS=1 python benchmarks/prefix_replay_server.py [--requests 20] [--repeats 5]
[--scale 0.125]``; a table on stderr, one JSON line on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from kvstate.lab.prefix.replay_server import replay_server
from kvstate.lab.workloads.traces import generate

MODEL = Path("models/ref-hybrid")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(extra: list[str]) -> tuple[subprocess.Popen[bytes], str]:
    port = _port()
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "kvstate.cli", "serve", "--model", str(MODEL), "--port", str(port), *extra]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited: {proc.stderr.read().decode()[-2000:] if proc.stderr else ''}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the server did not start within 120 s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--scale", type=float, default=0.125)
    args = ap.parse_args()
    vocab = int(json.loads((MODEL / "config.json").read_text())["vocab_size"])
    on, on_url = start([])
    off, off_url = start(["--no-cache"])
    try:
        warm = generate("chat", 4, seed=10_000, vocab=vocab, scale=args.scale)
        replay_server(on_url, warm, baseline_url=off_url)  # warm-up: first calls, allocator
        rows = []
        print(f"{'repeat':>6} {'reqs':>5} {'tokens':>7} {'reused':>7} {'TTFT cache s':>12} {'no cache s':>10} "
              f"{'ratio':>6}", file=sys.stderr)
        for k in range(args.repeats):
            reqs = generate("chat", args.requests, seed=k, vocab=vocab, scale=args.scale)
            r = replay_server(on_url, reqs, baseline_url=off_url)
            rows.append(r.as_json() | {"repeat": k, "overlap_tokens": sum(q.overlap for q in reqs)})
            print(f"{k:>6} {r.requests:>5} {r.tokens_total:>7} {r.tokens_reused:>7.0f} {r.ttft_s_median:>12.4f} "
                  f"{r.ttft_s_median_baseline:>10.4f} {r.ttft_s_median_baseline / r.ttft_s_median:>6.2f}",
                  file=sys.stderr, flush=True)
    finally:
        for p in (on, off):
            p.terminate()
            p.wait(30)
    cached = [r["ttft_s_median"] for r in rows]
    base = [r["ttft_s_median_baseline"] for r in rows]
    ratios = [b / a for a, b in zip(cached, base, strict=True)]
    summary = {
        "ttft_s_median": statistics.median(cached),
        "ttft_s_median_no_cache": statistics.median(base),
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "tokens_reused": sum(r["tokens_reused"] for r in rows),
        "tokens_total": sum(r["tokens_total"] for r in rows),
    }
    print(f"TTFT median {summary['ttft_s_median']:.4f} s with the cache vs {summary['ttft_s_median_no_cache']:.4f} s "
          f"without: {summary['ratio_median']:.2f}x ({summary['ratio_min']:.2f}-{summary['ratio_max']:.2f})",
          file=sys.stderr)
    print(json.dumps({"benchmark": "prefix_replay_server", "model": str(MODEL), "workload": "chat",
                      "scale": args.scale, "repeats": args.repeats, "summary": summary, "runs": rows}))


if __name__ == "__main__":
    main()
