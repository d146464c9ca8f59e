"""Benchmark: QuALITY-shaped requests on models/ref-hybrid with the document end declared, one engine vs
replicas sharing one Redis tier (CPU, one thread).

``--docs`` documents of 1,024 tokens, ``--questions`` short questions each, shuffled; every request
declares where it parts from the others (:func:`kvstate.lab.prefix.replay.declared_boundaries`: the
document's end). Reports

1. one engine: tokens reused, and what the **second** question to each document resumed from;
2. ``--replicas R`` engines round-robin sharing a redis-server (started here on a free loopback port
   unless ``--remote URL`` names a scratch database, which is flushed): tokens reused against one
   engine, and every document whose first request went to one replica and a later one to another —
   what that later request resumed from;
3. wall-clock with and without the cache: medians of ``--repeats`` interleaved repeats and the spread
   of the per-repeat ratio (both setups).

Prints a table on stderr and one JSON line on stdout. Usage:
``OMP_NUM_THREADS=1 python benchmarks/prefix_replicas.py [--docs 4] [--questions 4] [--replicas 2] [--repeats 5]``.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

from kvstate.lab.prefix.replay import replay
from kvstate.lab.workloads.traces import Request
from kvstate.models import load_model
from kvstate.prefix.config import PrefixCacheConfig

MODEL = Path("models/ref-hybrid")
BUDGET = 1 << 30
DOC = 1024


def quality_requests(vocab: int, docs: int, questions: int, seed: int = 0) -> tuple[list[Request], list[int]]:
    rng = random.Random(seed)
    texts = [tuple(rng.randrange(3, vocab) for _ in range(DOC)) for _ in range(docs)]
    reqs = [
        (d, texts[d] + tuple(rng.randrange(3, vocab) for _ in range(12))) for d in range(docs) for _ in range(questions)
    ]
    rng.shuffle(reqs)
    return [Request(t, f"doc{d}", 0, len(t)) for d, t in reqs], [d for d, _ in reqs]


def start_redis() -> tuple[subprocess.Popen[bytes], str]:
    exe = shutil.which("redis-server")
    if exe is None:
        sys.exit("redis-server is not installed (make setup installs it), or pass --remote redis://HOST:PORT/DB")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.5)
    return proc, f"redis://127.0.0.1:{port}/0"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--docs", type=int, default=4)
    ap.add_argument("--questions", type=int, default=4)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--remote", default=None, help="a scratch Redis database (flushed); default: start one")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = load_model(MODEL)
    vocab = int(model.get_output_embeddings().weight.shape[0])
    reqs, doc_ids = quality_requests(vocab, args.docs, args.questions)
    proc, url = (None, args.remote) if args.remote else start_redis()
    try:
        cfg = PrefixCacheConfig(BUDGET, slots_per_entry=8)
        one = replay(model, reqs, cfg, declare=True, repeats=args.repeats)
        many = replay(model, reqs, cfg, declare=True, repeats=args.repeats, replicas=args.replicas, remote=url)
    finally:
        if proc is not None:
            proc.kill()
            proc.wait(10)
    seen: dict[int, int] = {}
    on: dict[int, set[int]] = {}  # document -> replicas that served it
    second, across = [], []
    for i, d in enumerate(doc_ids):
        seen[d] = seen.get(d, 0) + 1
        if seen[d] == 2:
            second.append(one.per_request[i]["reused"])
        replica = i % args.replicas
        if d in on and replica not in on[d]:  # served before, but by another replica only
            across.append({"doc": d, "request": i, "reused": many.per_request[i]["reused"]})
        on.setdefault(d, set()).add(replica)
    out = {
        "benchmark": "prefix_replicas",
        "model": str(MODEL),
        "docs": args.docs,
        "questions": args.questions,
        "doc_tokens": DOC,
        "replicas": args.replicas,
        "repeats": args.repeats,
        "second_question_reused": second,
        "one": one.as_json(),
        "replicated": many.as_json(),
        "reuse_ratio": many.tokens_reused / one.tokens_reused if one.tokens_reused else float("nan"),
        "first_on_other_replica": across,
    }
    for name, r in (("one engine", one), (f"{args.replicas} replicas", many)):
        print(f"{name:>12}: reused {r.tokens_reused:,}/{r.tokens_total:,}  remote hits {r.remote_hits}  wall "
              f"{r.wall_s:.2f}s vs no cache {r.wall_s_no_cache:.2f}s  ratio {r.wall_ratio:.2f} "
              f"({r.wall_ratio_min:.2f}-{r.wall_ratio_max:.2f})", file=sys.stderr)
    print(f"second question to each document resumed from {second} of {DOC}", file=sys.stderr)
    print(f"first request to a document on this replica, served before on another: "
          f"{[a['reused'] for a in across]}", file=sys.stderr)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
