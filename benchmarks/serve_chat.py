"""Benchmark: time to first token of multi-turn chats through ``kvstate serve``, prefix cache on vs off.

Starts the server twice on ``models/ref-hybrid`` (``kvstate serve`` and ``kvstate serve --no-cache``, each
a subprocess with one thread) and drives both with the ``openai`` client, streaming: per repeat,
``--conversations`` conversations of ``--turns`` turns that share one system prompt (words of the
model's vocabulary, fresh per repeat so no repeat reuses another's), turns interleaved across the
conversations. Time to first token = request sent → first chunk with content. Repeats alternate which
server goes first; reported are medians over repeats of each repeat's mean, with the min–max spread.

Prints a table on stderr and one JSON line on stdout. Usage:
``OMP_NUM_THREADS=1 python benchmarks/serve_chat.py [--repeats 5] [--conversations 4] [--turns 6]
[--system-words 1024] [--user-words 48] [--max-tokens 16]``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from openai import OpenAI

from kvstate.serve.server import load_tokenizer

MODEL = Path("models/ref-hybrid")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """``kvstate serve`` in a subprocess on a free loopback port."""

    def __init__(self, model: Path, cache: bool) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        cmd = [sys.executable, "-m", "kvstate.cli", "serve", "--model", str(model), "--port", str(self.port)]
        self.proc = subprocess.Popen([*cmd, *([] if cache else ["--no-cache"])], env=env)
        deadline = time.monotonic() + 300
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvstate serve exited with {self.proc.returncode}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("kvstate serve did not start within 300 s")
            time.sleep(0.5)
        self.client = OpenAI(base_url=self.url + "/v1", api_key="x", max_retries=0, timeout=600)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def turn(server: Server, model_id: str, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    """One streamed chat turn: time to first content chunk, the reply and its usage."""
    t0 = time.perf_counter()
    first: float | None = None
    parts: list[str] = []
    usage = None
    stream = server.client.chat.completions.create(model=model_id, messages=messages, max_tokens=max_tokens,
                                                   stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].delta.content:
            if first is None:
                first = time.perf_counter() - t0
            parts.append(chunk.choices[0].delta.content)
    assert usage is not None
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return {"ttft": first if first is not None else time.perf_counter() - t0, "reply": "".join(parts),
            "prompt_tokens": usage.prompt_tokens, "cached_tokens": cached or 0}


def run_repeat(server: Server, model_id: str, words: list[str], seed: int, a: argparse.Namespace
               ) -> list[list[dict[str, Any]]]:
    """All conversations of one repeat; result[t][c] is turn t of conversation c."""
    rng = random.Random(seed)
    system = " ".join(rng.choice(words) for _ in range(a.system_words))
    questions = [[" ".join(rng.choice(words) for _ in range(a.user_words)) + " ?" for _ in range(a.turns)]
                 for _ in range(a.conversations)]
    convs = [[{"role": "system", "content": system}] for _ in range(a.conversations)]
    out: list[list[dict[str, Any]]] = []
    for t in range(a.turns):
        row = []
        for c, msgs in enumerate(convs):
            msgs.append({"role": "user", "content": questions[c][t]})
            r = turn(server, model_id, msgs, a.max_tokens)
            msgs.append({"role": "assistant", "content": r["reply"]})
            row.append(r)
        out.append(row)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=MODEL)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-words", type=int, default=1024)
    p.add_argument("--user-words", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=16)
    a = p.parse_args()
    tok = load_tokenizer(a.model)
    special = set(tok.all_special_tokens)
    words = [w for w, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1]) if w not in special]
    model_id = a.model.resolve().name
    servers = {"cache": Server(a.model, cache=True)}
    try:
        servers["no_cache"] = Server(a.model, cache=False)
        for s in servers.values():  # warm up: first-call allocations, thread pools
            turn(s, model_id, [{"role": "user", "content": " ".join(words[:8])}], 4)
        runs: dict[str, list[list[list[dict[str, Any]]]]] = {k: [] for k in servers}
        for r in range(a.repeats):
            order = ["cache", "no_cache"] if r % 2 == 0 else ["no_cache", "cache"]
            for name in order:
                runs[name].append(run_repeat(servers[name], model_id, words, 1000 + r, a))
            print(f"repeat {r + 1}/{a.repeats} done", file=sys.stderr)
    finally:
        for s in servers.values():
            s.close()
    report(runs, a)


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def report(runs: dict[str, list[list[list[dict[str, Any]]]]], a: argparse.Namespace) -> None:
    per_turn = []
    for t in range(a.turns):
        row: dict[str, Any] = {"turn": t + 1}
        for name, reps in runs.items():
            means = [_mean([r["ttft"] for r in rep[t]]) for rep in reps]
            row[f"{name}_ttft_s"] = statistics.median(means)
        cache_reps = runs["cache"]
        row["prompt_tokens"] = statistics.median(_mean([r["prompt_tokens"] for r in rep[t]]) for rep in cache_reps)
        row["reused_fraction"] = sum(r["cached_tokens"] for rep in cache_reps for r in rep[t]) / max(
            1, sum(r["prompt_tokens"] for rep in cache_reps for r in rep[t]))
        row["speedup"] = row["no_cache_ttft_s"] / row["cache_ttft_s"]
        per_turn.append(row)
    overall = {name: [_mean([r["ttft"] for row in rep for r in row]) for rep in reps] for name, reps in runs.items()}
    same = [x["reply"] == y["reply"] for rc, rn in zip(runs["cache"], runs["no_cache"], strict=True)
            for row_c, row_n in zip(rc, rn, strict=True) for x, y in zip(row_c, row_n, strict=True)]
    allc = [r for rep in runs["cache"] for row in rep for r in row]
    result = {
        "benchmark": "serve_chat",
        "model": str(a.model),
        "repeats": a.repeats,
        "conversations": a.conversations,
        "turns": a.turns,
        "system_words": a.system_words,
        "user_words": a.user_words,
        "max_tokens": a.max_tokens,
        "threads": os.environ.get("OMP_NUM_THREADS"),
        "ttft_median_s": {k: statistics.median(v) for k, v in overall.items()},
        "ttft_spread_s": {k: [min(v), max(v)] for k, v in overall.items()},
        "speedup": statistics.median(overall["no_cache"]) / statistics.median(overall["cache"]),
        "reused_fraction": sum(r["cached_tokens"] for r in allc) / sum(r["prompt_tokens"] for r in allc),
        "identical_replies": sum(same) / len(same),
        "per_turn": per_turn,
    }
    print(f"{'turn':>4} {'prompt tok':>10} {'reused':>7} {'TTFT cache s':>13} {'TTFT no cache s':>16} {'speedup':>8}",
          file=sys.stderr)
    for row in per_turn:
        print(f"{row['turn']:>4} {row['prompt_tokens']:>10.0f} {row['reused_fraction']:>7.1%} "
              f"{row['cache_ttft_s']:>13.4f} {row['no_cache_ttft_s']:>16.4f} {row['speedup']:>8.2f}", file=sys.stderr)
    med = result["ttft_median_s"]
    print(f"all turns: TTFT {med['cache']:.4f} s with the cache vs {med['no_cache']:.4f} s without "
          f"({result['speedup']:.2f}x); {result['reused_fraction']:.1%} of prompt tokens reused; "
          f"{result['identical_replies']:.0%} of replies identical", file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
