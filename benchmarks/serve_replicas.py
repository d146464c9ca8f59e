"""Benchmark: time to first token of a cross-replica prefix hit, two ``kvstate serve`` replicas on one Redis tier.

Starts a ``redis-server`` on a free loopback port (``--save '' --appendonly no``) and two replicas of
``kvstate serve --model M --remote redis://127.0.0.1:PORT/0`` (one thread each). Per repeat (``--repeats``,
interleaved; the replica that computes the document alternates), a fresh document of ``--doc-words`` words
from the model's vocabulary (seeded per repeat) is the ``system`` message of streamed chat requests, each
with a different ``--question-words``-word user question, ``--max-tokens`` tokens out:

(a) cold: the document's first request, on the origin replica (no cache anywhere holds it);
(b) local hit: another question, same replica;
(c) cross-replica hit: another question, the other replica (a local miss, resumed from Redis).

(b) and (c) alternate order across repeats. TTFT = request sent -> the first streamed chunk after the
``role`` chunk (the server sends that one before prefill). Around every (c) the other replica's
``/metrics`` are read: ``kvstate_prefix_remote_hits_total`` must rise by 1 (else the row is marked not a
remote hit) and ``kvstate_prefix_remote_reused_tokens_total`` says how many tokens came from Redis.
Reported: medians over repeats with min-max spread, the per-repeat ratio (c)/(b) and (c)/(a), and the
targets: median (c) <= 1.25 x median (b); (c) never slower than (a) (every repeat, and medians).

Usage: ``OMP_NUM_THREADS=1 python benchmarks/serve_replicas.py [--model models/ref-hybrid] [--repeats 7]
[--doc-words 1000] [--question-words 16] [--max-tokens 2] [--seed 1000] [--out FILE]``. Progress and a table
on stderr, one JSON line on stdout; ``--out`` appends the run, with provenance, to a ``kvstate-results/1`` file.
Ignored: more than two replicas, Redis on another host (loopback only), eviction (budget default).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kvstate.lab.provenance import Recorder, append_run
from serve_clients import Server, free_port, loadavg, scrape, vocab_words

MODEL = Path("models/ref-hybrid")
HITS, REUSED = "kvstate_prefix_remote_hits_total", "kvstate_prefix_remote_reused_tokens_total"


def log(msg: str) -> None:
    print(f"[serve_replicas {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def start_redis() -> tuple[subprocess.Popen[bytes], int]:
    exe = shutil.which("redis-server")
    if exe is None:
        sys.exit("redis-server is not installed (make setup installs it)")
    port = free_port()
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.5)
    if proc.poll() is not None:
        sys.exit(f"redis-server exited with {proc.returncode}")
    return proc, port


def ttft(server: Server, model_name: str, document: str, question: str, max_tokens: int) -> tuple[float, str]:
    """Streamed chat: seconds to the first chunk after the role chunk, and the reply."""
    body = {"model": model_name, "stream": True, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "system", "content": document}, {"role": "user", "content": question}]}
    t0 = time.perf_counter()
    first: float | None = None
    parts: list[str] = []
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=300) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{server.name}: HTTP {r.status_code}: {r.read()[:500]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            d = json.loads(line[6:])
            if "error" in d:
                raise RuntimeError(f"{server.name}: stream error {d['error']}")
            choice = (d.get("choices") or [{}])[0]
            delta = choice.get("delta") or {}
            if "role" in delta and not delta.get("content") and choice.get("finish_reason") is None:
                continue  # the role chunk, sent before prefill
            if first is None:
                first = time.perf_counter() - t0
            parts.append(delta.get("content") or "")
    return (first if first is not None else time.perf_counter() - t0), "".join(parts)


def spread(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=MODEL)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--doc-words", type=int, default=1000)
    ap.add_argument("--question-words", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1000)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.repeats < 1:
        sys.exit("--repeats must be >= 1")
    rec = Recorder(code=("serve", "prefix", "models"), models=[args.model], n=args.repeats, seeds=[args.seed],
                   tasks=["cold", "local-hit", "cross-replica-hit"], lengths=[args.doc_words, args.question_words],
                   settings={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "out"})
    words = vocab_words(args.model)
    work = Path(tempfile.mkdtemp(prefix="serve_replicas-"))
    redis_proc, port = start_redis()
    remote = f"redis://127.0.0.1:{port}/0"
    log(f"redis-server at {remote}; logs in {work}")
    load = {"start": loadavg()}
    servers: list[Server] = []
    rows: list[dict[str, Any]] = []
    try:
        servers = [Server(args.model, True, name, work, extra=["--remote", remote]) for name in ("A", "B")]
        name = servers[0].model_name()
        warm = random.Random(args.seed - 1)
        for s in servers:  # first-call allocations; a document of its own, never reused below
            ttft(s, name, " ".join(warm.choice(words) for _ in range(64)), "the", args.max_tokens)
        for r in range(args.repeats):
            rng = random.Random(args.seed * 1000 + r)
            doc = " ".join(rng.choice(words) for _ in range(args.doc_words))
            qs = [" ".join(rng.choice(words) for _ in range(args.question_words)) for _ in range(3)]
            origin, other = (servers[0], servers[1]) if r % 2 == 0 else (servers[1], servers[0])
            row: dict[str, Any] = {"repeat": r, "origin": origin.name, "other": other.name}
            row["cold_s"], _ = ttft(origin, name, doc, qs[0], args.max_tokens)
            time.sleep(0.2)  # let the write-through to Redis land before another replica asks
            steps = ["local", "cross"] if r % 2 == 0 else ["cross", "local"]
            for step in steps:
                if step == "local":
                    row["local_hit_s"], _ = ttft(origin, name, doc, qs[1], args.max_tokens)
                else:
                    before = scrape(other.url)
                    row["cross_hit_s"], _ = ttft(other, name, doc, qs[2], args.max_tokens)
                    after = scrape(other.url)
                    row["remote_hits_delta"] = after.get(HITS, 0) - before.get(HITS, 0)
                    row["remote_reused_tokens_delta"] = after.get(REUSED, 0) - before.get(REUSED, 0)
            row["order"] = steps
            row["load"] = loadavg()
            rows.append(row)
            log(f"repeat {r} (origin {origin.name}): cold {row['cold_s'] * 1e3:.1f} ms, local {row['local_hit_s'] * 1e3:.1f} "
                f"ms, cross {row['cross_hit_s'] * 1e3:.1f} ms (remote hits +{row['remote_hits_delta']:.0f}, "
                f"+{row['remote_reused_tokens_delta']:.0f} tokens from Redis)")
        metrics = {s.name: {k: v for k, v in scrape(s.url).items() if k.startswith(("kvstate_prefix_remote",
                                                                                     "kvstate_prefix_hits"))}
                   for s in servers}
    finally:
        for s in servers:
            s.stop()
        redis_proc.terminate()
        redis_proc.wait(10)
    load["end"] = loadavg()
    cold, local, cross = ([r[k] for r in rows] for k in ("cold_s", "local_hit_s", "cross_hit_s"))
    remote_ok = sum(r["remote_hits_delta"] >= 1 for r in rows)
    ratio_cl = [c / b for c, b in zip(cross, local, strict=True)]
    ratio_cc = [c / a for c, a in zip(cross, cold, strict=True)]
    summary = {"cold_s": spread(cold), "local_hit_s": spread(local), "cross_hit_s": spread(cross),
               "cross_over_local_per_repeat": spread(ratio_cl), "cross_over_cold_per_repeat": spread(ratio_cc),
               "cross_over_local_of_medians": statistics.median(cross) / statistics.median(local),
               "remote_hit_confirmed": f"{remote_ok}/{len(rows)}"}
    targets = {
        "cross-replica <= 1.25x local hit (medians)": {
            "value": summary["cross_over_local_of_medians"],
            "status": "met" if summary["cross_over_local_of_medians"] <= 1.25 else "missed"},
        "cross-replica never slower than cold (every repeat and medians)": {
            "value": max(ratio_cc),
            "status": "met" if max(ratio_cc) < 1 and statistics.median(cross) < statistics.median(cold) else "missed"},
        "every cross-replica request was a remote hit": {
            "value": remote_ok, "status": "met" if remote_ok == len(rows) else "missed"},
    }
    print(f"{'':>22} {'median ms':>9} {'min':>7} {'max':>7}", file=sys.stderr)
    for k in ("cold_s", "local_hit_s", "cross_hit_s"):
        s = summary[k]
        print(f"{k:>22} {s['median'] * 1e3:>9.1f} {s['min'] * 1e3:>7.1f} {s['max'] * 1e3:>7.1f}", file=sys.stderr)
    for k in ("cross_over_local_per_repeat", "cross_over_cold_per_repeat"):
        s = summary[k]
        print(f"{k:>30} {s['median']:.3f} [{s['min']:.3f}, {s['max']:.3f}]", file=sys.stderr)
    for k, v in targets.items():
        print(f"target {k}: {v['value']:.3f} -> {v['status']}", file=sys.stderr)
    print(f"remote hits confirmed {summary['remote_hit_confirmed']}; load average {load}", file=sys.stderr)
    out = {"benchmark": "serve_replicas", "model": str(args.model), "repeats": args.repeats,
           "doc_words": args.doc_words, "question_words": args.question_words, "max_tokens": args.max_tokens,
           "seed": args.seed, "summary": summary, "targets": targets, "metrics_end": metrics,
           "load_average": load, "cpus": os.cpu_count(), "rows": rows}
    if args.out is not None:
        append_run(args.out, out, rec.finish())
    print(json.dumps(out))


if __name__ == "__main__":
    main()
