"""Benchmark: ``kvstate serve`` at a real model's size — random Qwen3.5-0.8B dimensions, a 2K shared prefix, cache on vs off.

Builds a random-weight model from Qwen3.5-0.8B's published text configuration
(:func:`kvstate.models.tiny.qwen35_08b_config`: 24 layers, 18 Gated DeltaNet + 6 gated attention, hidden
1,024, vocabulary 248,320; ``AutoModelForCausalLM.from_config``, ``--dtype`` bf16 by default, seeded) and
saves it to a temporary directory with a word-level tokenizer of exactly 248,320 entries (ref-hybrid's
1,490 words and special ids, then filler words ``w1490 ...``), so the served vocabulary matches the
config's. Starts ``kvstate serve`` and ``kvstate serve --no-cache`` on it (``--threads`` each; both up, one
request at a time) and sends streamed ``/v1/completions`` requests: a shared prefix of ``--prefix-words``
words (one token each) + a fresh ``--question-words``-word question, ``--max-tokens`` out. The cached
server first gets one priming request (its cold TTFT is reported); then ``--repeats`` interleaved
repeats send one new question to each server (the order alternates). TTFT = request sent -> first
streamed chunk. Reported: TTFT medians with min-max spread, the cached / uncached ratio per repeat, the
prefix cache's bytes held by kind and peak (``/metrics`` ``kvstate_prefix_bytes``,
``kvstate_prefix_peak_bytes``), tokens reused, servers' RSS, and the load average.

Usage: ``OMP_NUM_THREADS=1 python benchmarks/serve_big.py [--prefix-words 2048] [--question-words 32]
[--repeats 5] [--max-tokens 1] [--dtype bfloat16|float32] [--threads 1] [--seed 1000] [--out FILE]``.
Progress and a table on stderr, one JSON line on stdout; ``--out`` appends the run, with provenance, to a
``kvstate-results/1`` file. Ignored: quality (random weights), decode speed, batching.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kvstate.lab.provenance import Recorder, append_run
from kvstate.models.tiny import qwen35_08b_config
from serve_clients import Server, loadavg, scrape

WORDS_FROM = Path("models/ref-hybrid")


def log(msg: str) -> None:
    print(f"[serve_big {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def build(out: Path, dtype: torch.dtype, seed: int) -> dict[str, Any]:
    """Random weights of Qwen3.5-0.8B's dimensions and a word-level tokenizer of its vocabulary size, in ``out``."""
    from transformers import AutoModelForCausalLM

    cfg = qwen35_08b_config()
    cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = 1, 2, 0  # the special ids of the tokenizer below
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(out)
    del model
    tok = json.loads((WORDS_FROM / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    n = len(vocab)
    vocab.update({f"w{i}": i for i in range(n, cfg.vocab_size)})
    assert len(vocab) == cfg.vocab_size
    (out / "tokenizer.json").write_text(json.dumps(tok))
    shutil.copy(WORDS_FROM / "tokenizer_config.json", out / "tokenizer_config.json")
    return {"parameters": params, "vocab_size": cfg.vocab_size, "layers": cfg.num_hidden_layers,
            "layer_types": {t: cfg.layer_types.count(t) for t in set(cfg.layer_types)}, "dtype": str(dtype),
            "weights_bytes": sum(f.stat().st_size for f in out.glob("*.safetensors")),
            "build_seconds": round(time.perf_counter() - t0, 1)}


def ttft(server: Server, model_name: str, prompt: str, max_tokens: int) -> float:
    body = {"model": model_name, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    t0 = time.perf_counter()
    first = None
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=900) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{server.name}: HTTP {r.status_code}: {r.read()[:500]!r}")
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                if '"error"' in line:
                    raise RuntimeError(f"{server.name}: {line}")
                if first is None:
                    first = time.perf_counter() - t0
    return first if first is not None else time.perf_counter() - t0


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def spread(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prefix-words", type=int, default=2048)
    ap.add_argument("--question-words", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=1)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1000)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "out"}
    rec = Recorder(code=("serve", "prefix", "models"), models=[WORDS_FROM], n=args.repeats, seeds=[args.seed],
                   tasks=["shared-prefix-ttft"], lengths=[args.prefix_words, args.question_words], settings=settings)
    tmp = Path(tempfile.mkdtemp(prefix="serve_big-"))
    model_dir = tmp / "qwen35-0.8b-random"
    model_dir.mkdir()
    load = {"start": loadavg()}
    log(f"building the model in {model_dir} ({args.dtype})")
    info = build(model_dir, getattr(torch, args.dtype), args.seed)
    log(f"built: {info}")
    words = [w for w in json.loads((model_dir / "tokenizer.json").read_text())["model"]["vocab"]
             if not w.startswith("<")]
    rng = random.Random(args.seed)
    prefix = " ".join(rng.choice(words) for _ in range(args.prefix_words))
    questions = [" ".join(rng.choice(words) for _ in range(args.question_words)) for _ in range(args.repeats + 2)]
    servers: list[Server] = []
    rows: list[dict[str, Any]] = []
    try:
        t0 = time.perf_counter()
        servers = [Server(model_dir, True, "cache", tmp, threads=args.threads),
                   Server(model_dir, False, "no-cache", tmp, threads=args.threads)]
        log(f"servers up in {time.perf_counter() - t0:.0f} s")
        name = servers[0].model_name()
        for s in servers:  # first-call allocations, on a prompt that shares nothing with the prefix
            ttft(s, name, "w99999 w123456", 1)
        cold = ttft(servers[0], name, prefix + " " + questions[0], args.max_tokens)
        log(f"cached server, priming request (cold): {cold:.2f} s")
        for r in range(args.repeats):
            q = questions[r + 1]
            order = servers if r % 2 == 0 else servers[::-1]
            row: dict[str, Any] = {"repeat": r, "first": order[0].name}
            for s in order:
                row[s.name + "_s"] = ttft(s, name, prefix + " " + q, args.max_tokens)
            row["load"] = loadavg()
            rows.append(row)
            log(f"repeat {r}: cache {row['cache_s']:.2f} s, no-cache {row['no-cache_s']:.2f} s")
        m = scrape(servers[0].url)
        rss = {s.name: round(rss_mib(s.proc.pid), 1) for s in servers}
    finally:
        for s in servers:
            s.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    load["end"] = loadavg()
    cache_bytes = {k.split('"')[1]: v for k, v in m.items() if k.startswith("kvstate_prefix_bytes{")}
    counters = {k: m.get(k) for k in ("kvstate_prefix_peak_bytes", "kvstate_prefix_budget_bytes",
                                      "kvstate_prefix_hits_total", "kvstate_prefix_requests_total",
                                      "kvstate_prefix_reused_tokens_total", "kvstate_prefix_recomputed_tokens_total")}
    c, u = [r["cache_s"] for r in rows], [r["no-cache_s"] for r in rows]
    summary = {"cold_cached_server_s": cold, "cache_s": spread(c), "no_cache_s": spread(u),
               "cache_over_no_cache_per_repeat": spread([a / b for a, b in zip(c, u, strict=True)]),
               "prefix_bytes_by_kind": cache_bytes, "prefix_bytes_total": sum(cache_bytes.values()),
               "counters": counters, "server_rss_mib": rss}
    print(f"{'':>10} {'TTFT median s':>13} {'min':>7} {'max':>7}", file=sys.stderr)
    for k in ("cache_s", "no_cache_s"):
        print(f"{k:>10} {summary[k]['median']:>13.3f} {summary[k]['min']:>7.3f} {summary[k]['max']:>7.3f}",
              file=sys.stderr)
    rat = summary["cache_over_no_cache_per_repeat"]
    print(f"cold (cached server's first) {cold:.3f} s; cache / no-cache per repeat {rat['median']:.3f} "
          f"[{rat['min']:.3f}, {rat['max']:.3f}]; prefix cache holds {summary['prefix_bytes_total'] / 2**20:.1f} MiB "
          f"{ {k: round(v / 2**20, 2) for k, v in cache_bytes.items()} } (peak "
          f"{(counters['kvstate_prefix_peak_bytes'] or 0) / 2**20:.1f} MiB); RSS MiB {rss}; load {load}",
          file=sys.stderr)
    out = {"benchmark": "serve_big", "model": "random Qwen3.5-0.8B dimensions (kvstate.models.tiny.qwen35_08b_config)",
           "model_info": info, "prefix_words": args.prefix_words, "question_words": args.question_words,
           "repeats": args.repeats, "max_tokens": args.max_tokens, "threads": args.threads, "seed": args.seed,
           "summary": summary, "load_average": load, "cpus": os.cpu_count(), "rows": rows}
    if args.out is not None:
        append_run(args.out, out, rec.finish())
    print(json.dumps(out))


if __name__ == "__main__":
    main()
