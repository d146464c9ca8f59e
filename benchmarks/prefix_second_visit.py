"""Benchmark: the second visit of a shared prefix on a hybrid, grid checkpoints off vs on, flush-then-prime.

SGLang's protocol for prefix-cache hit rates: flush the cache, send each of ``--prefixes`` distinct
``--prefix-tokens``-token prefixes once (each with its own ``--suffix-tokens`` tail: the prime), then a
probe per prefix that shares it and diverges right after it (a new tail: the 2nd visit). Per round and arm
the prefix cache is built afresh (the flush: an empty tree and no overlap statistics) and every request runs
the server's path at concurrency 1 in this process: :class:`kvstate.serve.generation.Generator` prefills
through the prefix cache in calls of ``--chunk`` tokens (``kvstate serve``'s ``--max-tokens-per-step``
default), decodes ``--output-tokens`` greedy tokens and inserts prompt + reply. The arms are the prefix
cache without grid checkpoints (``off``) and with ``GridConfig(block=B)`` for each ``--blocks`` B (``on-B``),
interleaved (their order rotates by round), one thread.

Reports per arm: the fraction of 2nd visits restoring >= 90% of the prefix (Wilson interval; with
``--diverge anywhere`` a probe shares a uniform random depth of it, and the share is of that depth), the
restored tokens, the TTFT of primes (cold prefills: what the grid's captures cost) and of 2nd visits (prefill + the
first token's choice; no HTTP), as medians over rounds of each round's median with the rounds' spread, and
the per-round ratio to ``off``. Ignored: the HTTP layer, concurrency > 1, sampling.

Usage: ``OMP_NUM_THREADS=1 python benchmarks/prefix_second_visit.py [--model models/ref-hybrid] [--rounds 5]
[--prefixes 4] [--prefix-tokens 1024] [--suffix-tokens 64] [--output-tokens 16] [--blocks 256] [--chunk 512]
[--diverge end|anywhere] [--seed 7] [--out FILE]``. A table on stderr, one JSON line on stdout; ``--out`` appends the run with its
provenance.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from kvstate.lab.provenance import Recorder, append_run
from kvstate.lab.stats import timing, wilson
from kvstate.models import load_model
from kvstate.models.loading import load_tokenizer
from kvstate.prefix import PrefixCacheConfig
from kvstate.prefix.engine import SparsePrefixCache
from kvstate.prefix.grid import GridConfig
from kvstate.serve.generation import GenerationRequest, Generator
from kvstate.serve.sampling import SamplingParams

HIT_SHARE = 0.9  # a 2nd visit counts when it restores at least this share of the prefix
TARGET = 0.95  # ... and at least this share of the 2nd visits should


def log(msg: str) -> None:
    print(f"[prefix_second_visit {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def word_ids(tokenizer: Any, vocab: int) -> list[int]:
    """Token ids a prompt may use: the vocabulary less the special tokens."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    return [i for i in range(vocab) if i not in special]


def workload(ids: list[int], bos: tuple[int, ...], prefixes: int, prefix_len: int, suffix_len: int,
             rng: random.Random, anywhere: bool = False) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """Primes and probes: prefix i + its own tail, then prefix i + a tail whose first token differs. Each
    prefix starts with ``bos`` (what the tokenizer puts before every prompt), so prefixes share it.
    ``anywhere``: a probe shares only the first ``d`` tokens of its prime, ``d`` uniform in ``[1, prefix_len]``."""
    primes, probes = [], []
    for _ in range(prefixes):
        pre = bos + tuple(rng.choice(ids) for _ in range(prefix_len - len(bos)))
        a = tuple(rng.choice(ids) for _ in range(suffix_len))
        prime = pre + a
        d = rng.randint(1, prefix_len) if anywhere else prefix_len
        b = tuple(rng.choice([i for i in ids if i != prime[d]]) if k == 0 else rng.choice(ids)
                  for k in range(suffix_len + prefix_len - d))
        primes.append(prime)
        probes.append(prime[:d] + b)
    return primes, probes


def shared(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """Tokens ``a`` and ``b`` have in common from the start."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


@torch.no_grad()
def serve_one(gen: Generator, prompt: tuple[int, ...], max_tokens: int, chunk: int) -> dict[str, Any]:
    """One request at concurrency 1 as the server runs it: chunked prefill, decode, insert; its TTFT."""
    req = GenerationRequest(prompt, max_tokens, sampling=SamplingParams(temperature=0.0, ignore_eos=True))
    d = gen.begin(req, lambda _: None, lambda: False)
    t0 = time.perf_counter()
    p = gen.prefill(d, chunk=chunk)
    go = d.take(p.logits)
    ttft = time.perf_counter() - t0
    cache = p.cache
    while go:
        logits = gen._forward([d.next_token], d.covered, cache)[0]
        d.covered += 1
        go = d.take(logits)
    g = gen.finish(d, cache)
    return {"ttft_s": ttft, "reused": g.reused_tokens, "lost": g.lost_tokens}


def run_arm(model: Any, tokenizer: Any, grid: GridConfig | None, primes: list[tuple[int, ...]],
            probes: list[tuple[int, ...]], a: argparse.Namespace) -> dict[str, Any]:
    cache = SparsePrefixCache(model, PrefixCacheConfig(a.budget_bytes), grid=grid)  # the flush: a fresh store
    gen = Generator(model, tokenizer, cache)
    prime = [serve_one(gen, x, a.output_tokens, a.chunk) for x in primes]
    probe = [serve_one(gen, x, a.output_tokens, a.chunk) | {"shared": shared(x, y)} for x, y in zip(probes, primes,
                                                                                               strict=True)]
    return {"prime": prime, "probe": probe, "grid_bytes": cache.grid_ledger.nbytes,
            "bytes": cache.bytes_by_kind()}


def summarize(rounds: list[dict[str, Any]], arm: str) -> dict[str, Any]:
    probes = [r for rd in rounds for r in rd[arm]["probe"]]
    hits = sum(r["reused"] >= HIT_SHARE * r["shared"] for r in probes)
    share = wilson(hits, len(probes))
    prime_t = [statistics.median(r["ttft_s"] for r in rd[arm]["prime"]) for rd in rounds]
    probe_t = [statistics.median(r["ttft_s"] for r in rd[arm]["probe"]) for rd in rounds]
    pt, vt = timing(prime_t, what=f"{arm} prime TTFT"), timing(probe_t, what=f"{arm} 2nd-visit TTFT")
    return {
        "second_visits": len(probes),
        "restored_ge_90pct": hits,
        "share_ge_90pct": share.value, "share_ci": share.ci,
        "restored_tokens": sorted(r["reused"] for r in probes),
        "restored_tokens_median": statistics.median(r["reused"] for r in probes),
        "shared_tokens_total": sum(r["shared"] for r in probes),
        "restored_tokens_total": sum(r["reused"] for r in probes),
        "prime_ttft_s": {"median": pt.value, "spread": [min(prime_t), max(prime_t)], "rounds": prime_t},
        "second_visit_ttft_s": {"median": vt.value, "spread": [min(probe_t), max(probe_t)], "rounds": probe_t},
        "grid_bytes_held": [rd[arm]["grid_bytes"] for rd in rounds],
        "bytes_by_kind_last_round": rounds[-1][arm]["bytes"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=Path("models/ref-hybrid"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prefixes", type=int, default=4)
    ap.add_argument("--prefix-tokens", type=int, default=1024)
    ap.add_argument("--suffix-tokens", type=int, default=64)
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--blocks", type=int, nargs="+", default=[256], help="a grid arm per GridConfig.block")
    ap.add_argument("--chunk", type=int, default=512, help="prefill tokens per forward call (the server's default)")
    ap.add_argument("--budget-bytes", type=int, default=1 << 30)
    ap.add_argument("--diverge", choices=("end", "anywhere"), default="end",
                    help="end: probes diverge right after the prefix (SGLang's protocol); anywhere: at a uniform depth")
    ap.add_argument("--seed", type=int, default=7, help="workload seed (a dev seed: < 1000)")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    torch.set_num_threads(1)
    rec = Recorder(code=("prefix", "serve", "models"), models=[a.model], n=a.rounds * a.prefixes, seeds=[a.seed],
                   lengths=[a.prefix_tokens + a.suffix_tokens],
                   settings={k: v for k, v in vars(a).items() if k not in ("model", "out")})
    tokenizer, model = load_tokenizer(a.model), load_model(a.model)
    vocab = int(model.get_output_embeddings().weight.shape[0])
    ids = word_ids(tokenizer, vocab)
    bos = tuple(tokenizer("x").input_ids[:1]) if getattr(tokenizer, "bos_token_id", None) is not None else ()
    arms: dict[str, GridConfig | None] = {"off": None, **{f"on-{b}": GridConfig(block=b) for b in a.blocks}}
    warm = workload(ids, bos, 1, 256, 16, random.Random(a.seed + 10_000))
    for grid in arms.values():  # warm-up: first calls of each shape are slower
        run_arm(model, tokenizer, grid, *warm, a)
    rounds: list[dict[str, Any]] = []
    for r in range(a.rounds):
        primes, probes = workload(ids, bos, a.prefixes, a.prefix_tokens, a.suffix_tokens, random.Random(a.seed * 1000 + r), a.diverge == "anywhere")
        names = list(arms)
        order = names[r % len(names):] + names[: r % len(names)]
        rd: dict[str, Any] = {}
        for arm in order:
            rd[arm] = run_arm(model, tokenizer, arms[arm], primes, probes, a)
            log(f"round {r} {arm}: 2nd visits restored {[x['reused'] for x in rd[arm]['probe']]}, TTFT "
                f"{[round(x['ttft_s'] * 1e3) for x in rd[arm]['probe']]} ms (primes "
                f"{[round(x['ttft_s'] * 1e3) for x in rd[arm]['prime']]} ms)")
        rounds.append(rd)
    out: dict[str, Any] = {"benchmark": "prefix_second_visit", "model": str(a.model), "hit_share": HIT_SHARE,
                           "diverge": a.diverge,
                           "bos": list(bos)}
    for arm in arms:
        out[arm] = summarize(rounds, arm)
    def med(rd: dict[str, Any], arm: str, kind: str) -> float:
        return statistics.median(x["ttft_s"] for x in rd[arm][kind])

    for arm in list(arms)[1:]:
        s = out[arm]
        for kind, key in (("probe", "second_visit_ttft_over_off"), ("prime", "prime_ttft_over_off")):
            ratio = [med(rd, arm, kind) / med(rd, "off", kind) for rd in rounds]
            s[key] = {"median": statistics.median(ratio), "spread": [min(ratio), max(ratio)], "rounds": ratio}
        lo, hi = s["share_ci"]
        s["target"] = {"share_ge_90pct_at_least": TARGET,
                       "status": "met" if lo >= TARGET else "missed" if hi < TARGET else "undecided"}
    for arm in arms:
        s = out[arm]
        extra = "" if arm == "off" else (
            f"; 2nd-visit TTFT / off {s['second_visit_ttft_over_off']['median']:.3f}, prime TTFT / off "
            f"{s['prime_ttft_over_off']['median']:.3f}, target {s['target']['status']}")
        print(f"{arm:>7}: 2nd visits >= 90% restored {s['restored_ge_90pct']}/{s['second_visits']} "
              f"{s['share_ge_90pct']:.2f} [{s['share_ci'][0]:.2f}, {s['share_ci'][1]:.2f}], restored median "
              f"{s['restored_tokens_median']}, TTFT 2nd visit {s['second_visit_ttft_s']['median'] * 1e3:.1f} ms "
              f"{[round(x * 1e3, 1) for x in s['second_visit_ttft_s']['spread']]}, prime "
              f"{s['prime_ttft_s']['median'] * 1e3:.1f} ms{extra}", file=sys.stderr)
    print(json.dumps(out))
    if a.out is not None:
        append_run(a.out, out, rec.finish())


if __name__ == "__main__":
    main()
