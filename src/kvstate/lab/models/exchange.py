"""A real exchange with ``kvstate serve`` on the real model, and its time to first token with and without a hit.

Sparse prefix caching ("Sparse Prefix Caching for Hybrid and Recurrent LLM Serving", ``docs/techniques.md#position``)
where users meet it: a chat about a ~2K-token document. ``kvstate serve --model models/smollm2-135m-instruct`` is
started as a subprocess (the command a user runs, its defaults) and spoken to over HTTP with streaming chat
completions; the time to first token (TTFT) is from sending the request to the first streamed content chunk, and
the cached tokens are the server's ``usage.prompt_tokens_details.cached_tokens``.

- **The exchange** (shown in the report): a system message holding the document (licence text with two facts
  planted in it), a first question, the model's reply, then a second question in the same conversation — the
  second request carries the whole first turn, so the server restores it from the cache.
- **The timing** (a timing experiment through :func:`kvstate.lab.experiment.run`, >= 5 interleaved repeats):
  ``cold`` asks about a document the server has never seen (a full prefill); ``warm`` first sends one question
  about another fresh document (untimed), then times a different question about it — the same request shape as
  ``cold``, its document prefix cached. Target (issue 43, committed before the run): warm TTFT p50 <= 1/2 cold.

Run as a module::

    python -m kvstate.lab.models.exchange --seed 1056 --out models/smollm2/serve_exchange.json

Ignored: concurrency (one request in flight; GuideLLM at c = 8 is the serving benchmark's), sampling (greedy).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from kvstate.lab.workloads import realtext as rt

EXPERIMENT = "serve-real-exchange"
PRIMED = {"cold": False, "warm": True}  # the experiment's arms: is the document asked about once before the timed request
METHODS = tuple(PRIMED)
DOC_WORDS = 1400  # ~2K tokens of licence text with the chat template around it
SYSTEM = "You are a helpful assistant. Answer questions about this document in one short sentence.\n\n{doc}"
START_TIMEOUT_S = 180.0


def document(seed: int, index: int) -> tuple[str, list[tuple[str, str]]]:
    """A licence-text document of :data:`DOC_WORDS` words with two facts planted in it, and ``(question,
    answer)`` for each fact."""
    rng = np.random.default_rng([seed, index])
    sentences = rt.haystack()
    keys = [str(k) for k in rng.choice(rt.KEYS, size=2, replace=False)]
    nums = [str(int(rng.integers(1_000_000, 10_000_000))) for _ in keys]
    start = int(rng.integers(0, len(sentences)))
    words: list[str] = []
    j = start
    while len(words) < DOC_WORDS:
        words += sentences[j % len(sentences)].split()
        j += 1
    words = words[:DOC_WORDS]
    for k, (key, num) in enumerate(zip(keys, nums, strict=True)):
        at = int((0.25 + 0.5 * k) * len(words))
        words[at:at] = f"The special magic number for {key} is {num}.".split()
    return " ".join(words), [(f"What is the special magic number for {k}?", n) for k, n in zip(keys, nums, strict=True)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def serving(model_dir: Path, log: Path) -> Iterator[str]:
    """``kvstate serve --model model_dir`` on a free local port, its defaults otherwise; yields its URL."""
    import httpx

    port = _free_port()
    exe = Path(sys.executable).with_name("kvstate")
    argv = [str(exe), "serve", "--model", str(model_dir), "--port", str(port)]
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "NO_COLOR": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        t0 = time.monotonic()
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"kvstate serve exited with {proc.returncode}; its log: {log}")
            try:
                if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > START_TIMEOUT_S:
                raise RuntimeError(f"kvstate serve did not answer within {START_TIMEOUT_S:.0f} s; its log: {log}")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def chat(url: str, model: str, messages: Sequence[dict[str, str]], max_tokens: int = 32) -> dict[str, Any]:
    """One streamed greedy chat completion: its reply, TTFT (s), total seconds and cached prompt tokens."""
    import httpx

    body = {"model": model, "messages": list(messages), "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    text: list[str] = []
    ttft: float | None = None
    usage: dict[str, Any] = {}
    t0 = time.perf_counter()
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"kvstate serve answered {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for c in chunk.get("choices") or []:
                piece = (c.get("delta") or {}).get("content")
                if piece:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    text.append(piece)
            usage = chunk.get("usage") or usage
    details = usage.get("prompt_tokens_details") or {}
    return {"reply": "".join(text), "ttft_s": ttft if ttft is not None else float("nan"),
            "seconds": time.perf_counter() - t0, "prompt_tokens": usage.get("prompt_tokens"),
            "cached_tokens": int(details.get("cached_tokens") or 0)}


def exchange(url: str, model: str, seed: int) -> list[dict[str, Any]]:
    """The two-turn conversation the report shows (document index 0 of ``seed``)."""
    doc, qa = document(seed, 0)
    messages = [{"role": "system", "content": SYSTEM.format(doc=doc)}]
    turns = []
    for question, answer in qa:
        messages.append({"role": "user", "content": question})
        got = chat(url, model, messages)
        messages.append({"role": "assistant", "content": got["reply"]})
        turns.append({"question": question, "answer": answer, "correct": answer in got["reply"], **got})
    return turns


def plan(model_dir: Path, seed: int, repeats: int) -> Any:
    from kvstate.lab.experiment import Experiment, Target

    return Experiment(
        axis="position", name=EXPERIMENT, methods=METHODS, seeds=(seed,), tasks=("chat-2k-document",),
        lengths=(2048,), repeats=repeats, kind="timing",
        targets=(Target("cached TTFT p50 <= 1/2 uncached at a 2K shared prefix (real model, c = 1)", "warm",
                        "ratio", 0.5, higher_is_better=False, against="cold"),),
        code=("lab/models/exchange.py", "serve", "prefix", "models"), models=(str(model_dir),),
        settings={"doc_words": DOC_WORDS, "max_tokens": 32, "server": "kvstate serve (defaults)",
                  "client": "httpx streaming chat completions"})


def main(argv: list[str] | None = None) -> int:
    from kvstate.errors import KVStateError
    from kvstate.lab.experiment import Cell, Measurement, check_out, run
    from kvstate.lab.models.cli import REAL_MODEL, missing_hint

    ap = argparse.ArgumentParser(prog="python -m kvstate.lab.models.exchange", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=REAL_MODEL)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--overwrite", action="store_true")
    args = ap.parse_args(argv)
    if not (args.model / "config.json").is_file():
        print(f"error: {missing_hint(args.model)}", file=sys.stderr)
        return 2
    try:
        e = plan(args.model, args.seed, args.repeats)
        check_out(e, args.out, overwrite=args.overwrite)
        log = Path(os.environ.get("TMPDIR", "/tmp")) / f"kvstate-exchange-{os.getpid()}.log"
        name = args.model.name
        with serving(args.model, log) as url:
            turns = exchange(url, name, args.seed)
            for t in turns:
                print(f"exchange: Q {t['question']!r} -> {t['reply']!r} (cached {t['cached_tokens']} of "
                      f"{t['prompt_tokens']}, TTFT {t['ttft_s'] * 1e3:.0f} ms)", file=sys.stderr, flush=True)

            def measure(cell: Cell) -> Measurement:
                doc, qa = document(args.seed, 1 + 2 * cell.repeat + METHODS.index(cell.method))
                system = {"role": "system", "content": SYSTEM.format(doc=doc)}
                if PRIMED[cell.method]:
                    chat(url, name, [system, {"role": "user", "content": qa[0][0]}])
                got = chat(url, name, [system, {"role": "user", "content": qa[1][0]}])
                print(f"exchange: repeat {cell.repeat + 1} {cell.method}: TTFT {got['ttft_s'] * 1e3:.0f} ms, cached "
                      f"{got['cached_tokens']} of {got['prompt_tokens']}", file=sys.stderr, flush=True)
                return Measurement([got["ttft_s"]], {f"cached_tokens_r{cell.repeat}": got["cached_tokens"],
                                                     "prompt_tokens": got["prompt_tokens"]})

            doc_out = run(e, measure, out=None)
    except (KVStateError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    result = {k: doc_out[k] for k in ("experiment", "rows", "pooled", "decisions")}
    result["exchange"] = turns
    if args.out is not None:
        from kvstate.lab.cli_output import write_results

        write_results(args.out, result, doc_out["provenance"], overwrite=args.overwrite)
    for d in doc_out["decisions"]:
        print(f"{d['label']}: {d['value']:.3f} {d['ci']} -> {d['status']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
