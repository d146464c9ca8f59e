"""The real model behind three servers under GuideLLM: ``kvstate serve`` with its prefix cache, without it, and
HuggingFace's own ``transformers serve`` — TTFT and output tokens/s side by side at a 2K shared prefix.

Sparse prefix caching ("Sparse Prefix Caching for Hybrid and Recurrent LLM Serving", ``docs/techniques.md#position``)
on SmolLM2-135M-Instruct, an attention-only model (every block a checkpoint), against the server a HuggingFace user
already has. Three servers run at once on free local ports, one thread each, fp32 on the CPU:

- ``kvstate``: ``kvstate serve --model models/smollm2-135m-instruct`` (its defaults: the prefix cache on);
- ``kvstate-nocache``: the same with ``--no-cache``;
- ``hf-serve``: ``transformers serve <dir> --device cpu --dtype float32`` from ``.venv-peer``
  (``make peer``), with ``--continuous-batching`` (paged attention, its blocks shared between requests with the
  same prefix) and a paged cache of :data:`CB_BLOCKS` blocks of :data:`CB_BLOCK` tokens, or sequential
  (``--peer-mode``).

The load is GuideLLM's (``.venv-guidellm``, ``make clients``): streaming ``/v1/completions`` with a shared prefix of
2,048 tokens of licence text (:mod:`kvstate.lab.workloads.realtext`'s haystack) and 64 fresh tokens after it,
at most 32 output tokens each (greedy; a reply may end at EOS, the same on every server), at concurrency 1 and 8 (``--requests-c1`` /
``--requests-c8`` requests). A method is a server at a concurrency (``kvstate@c8``); a repeat gives every method a
fresh prefix, primed on its server by one untimed request first (a system prompt already served once), and the
methods' order rotates between repeats (interleaved). Two timing experiments read the same GuideLLM runs:
``ttft`` (GuideLLM's TTFT p50 per run) and ``per-token`` (seconds per output token: 1 / GuideLLM's output
tokens/s). Targets (issue 43, committed before the run): cached TTFT p50 <= 1/2 uncached at c = 1 and at c = 8;
output tokens/s at c = 8 >= 3x c = 1 (kvstate); against ``transformers serve``, TTFT p50 and tokens/s each a ratio
(goal: kvstate ahead, ratio < 1 in cost). Every server's first reply to the primed prompt is kept to check the
servers agree (greedy).

Run as a module (``make clients peer`` first)::

    OMP_NUM_THREADS=1 python -m kvstate.lab.models.serve_peer --seed 1058 --out models/smollm2/serve_peer.json

Ignored: chat requests (the exchange covers the chat path), sampling, concurrency above 8, the prompt-tokens
count the peer reports (GuideLLM counts with the model's tokenizer for both).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvstate.lab.workloads import realtext as rt

REPO = Path(__file__).resolve().parents[4]
GUIDELLM = REPO / ".venv-guidellm" / "bin" / "guidellm"
PEER = REPO / ".venv-peer" / "bin" / "transformers"
SERVERS = ("kvstate", "kvstate-nocache", "hf-serve")
CONCURRENCY = (1, 8)
PREFIX_TOKENS, PROMPT_TOKENS, OUTPUT_TOKENS = 2048, 64, 32
START_TIMEOUT_S = 300.0
# the peer's paged KV cache, sized for 8 streams of prefix + prompt + output with room for cached prefixes (its
# default on a CPU takes ~0.9 of the machine's memory: 14 GB here)
CB_BLOCK, CB_BLOCKS = 256, 160
CLIENT_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
              "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def method(server: str, c: int) -> str:
    return f"{server}@c{c}"


METHODS = tuple(method(s, c) for c in CONCURRENCY for s in SERVERS)


def split_method(name: str) -> tuple[str, int]:
    server, _, c = name.rpartition("@c")
    return server, int(c)


@dataclass(frozen=True)
class Load:
    """The GuideLLM load of one run (a frozen configuration)."""

    prefix_tokens: int = PREFIX_TOKENS
    prompt_tokens: int = PROMPT_TOKENS
    output_tokens: int = OUTPUT_TOKENS
    requests_c1: int = 6
    requests_c8: int = 16

    def requests(self, c: int) -> int:
        return self.requests_c1 if c == 1 else self.requests_c8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def launch(name: str, argv: Sequence[str], port: int, log: Path, env: Mapping[str, str]) -> Iterator[str]:
    """Start a server process, wait until ``/v1/models`` answers, yield its URL; stop it on exit."""
    import httpx

    with open(log, "wb") as out:
        proc = subprocess.Popen(list(argv), stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env})
    url = f"http://127.0.0.1:{port}"
    try:
        t0 = time.monotonic()
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}: {log.read_text(errors='replace')[-800:]}")
            try:
                if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > START_TIMEOUT_S:
                raise RuntimeError(f"{name} did not answer within {START_TIMEOUT_S:.0f} s; its log: {log}")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def server_argv(server: str, model_dir: Path, port: int, peer_mode: str) -> list[str]:
    """The command line of each server (one thread each, fp32 on the CPU)."""
    if server == "hf-serve":
        return [str(PEER), "serve", str(model_dir.resolve()), "--port", str(port), "--host",
                "127.0.0.1", "--device", "cpu", "--dtype", "float32",
                *(["--continuous-batching", "--cb-block-size", str(CB_BLOCK), "--cb-num-blocks", str(CB_BLOCKS)]
                  if peer_mode == "continuous-batching" else [])]
    exe = Path(sys.executable).with_name("kvstate")
    return [str(exe), "serve", "--model", str(model_dir), "--port", str(port),
            *(["--no-cache"] if server == "kvstate-nocache" else [])]


def texts(tokenizer: Any, seed: int, index: int, load: Load, n_prompts: int) -> tuple[str, list[str]]:
    """A shared prefix of ``load.prefix_tokens`` tokens and ``n_prompts`` distinct prompts of
    ``load.prompt_tokens`` tokens, all licence text, cut by the model's tokenizer (``index``: a fresh set)."""
    sentences = rt.haystack()
    rng = np.random.default_rng([seed, index])

    def take(n_tokens: int) -> str:
        j = int(rng.integers(0, len(sentences)))
        ids: list[int] = []
        while len(ids) < n_tokens:
            ids += tokenizer(" " + sentences[j % len(sentences)], add_special_tokens=False)["input_ids"]
            j += 1
        return str(tokenizer.decode(ids[:n_tokens]))

    return take(load.prefix_tokens), [take(load.prompt_tokens) for _ in range(n_prompts)]


def write_dataset(path: Path, prefix: str, prompts: Sequence[str], load: Load) -> None:
    """GuideLLM rows (columns ``prefix``, ``prompt``, its token count): one shared prefix, fresh prompts. No output
    count: GuideLLM would then send ``ignore_eos``, which ``transformers serve`` refuses (422, "Unexpected fields");
    the length comes from the backend's ``max_tokens`` instead, the same for every server, so a reply may end at
    EOS before it (greedy: the same reply on every server)."""
    with path.open("w") as f:
        for p in prompts:
            f.write(json.dumps({"prefix": prefix, "prompt": p, "prompt_tokens_count": load.prompt_tokens}) + "\n")


def complete(url: str, model: str, prompt: str, max_tokens: int) -> str:
    """One greedy, non-streamed ``/v1/completions`` request; its text (the priming request, untimed)."""
    import httpx

    r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                                  "temperature": 0}, timeout=900)
    if r.status_code != 200:
        raise RuntimeError(f"{url} answered {r.status_code} to a completion: {r.text[:300]}")
    return str(r.json()["choices"][0]["text"])


def scrape(url: str) -> dict[str, float]:
    """A server's ``/metrics`` as ``{"name{labels}": value}`` ({} where it has none)."""
    import httpx

    try:
        r = httpx.get(url + "/metrics", timeout=30)
    except httpx.HTTPError:
        return {}
    if r.status_code != 200:
        return {}
    out: dict[str, float] = {}
    for line in r.text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            try:
                out[key] = float(value)
            except ValueError:
                continue
    return out


def _stat(metric: Mapping[str, Any] | None, key: str) -> float | None:
    s = (metric or {}).get("successful") or {}
    if not s.get("count"):
        return None
    return float(s["percentiles"][key]) if key.startswith("p") else float(s[key])


def guidellm(url: str, model: str, model_dir: Path, data: Path, c: int, requests: int, max_tokens: int, work: Path,
             tag: str) -> dict[str, Any]:
    """One GuideLLM run at concurrency ``c``: its TTFT p50 / p99, output tokens/s, ITL p50 and failures."""
    out = work / f"guidellm-{tag}.json"
    out.unlink(missing_ok=True)
    backend = {"kind": "openai_http", "target": url, "model": model, "request_format": "/v1/completions",
               "timeout": 900, "max_tokens": max_tokens}
    profile = {"kind": "synchronous"} if c == 1 else {"kind": "concurrent", "streams": [c]}
    cmd = [str(GUIDELLM), "run", "--backend", json.dumps(backend), "--profile", json.dumps(profile),
           "--constraint", f"kind=max_requests,count={requests}",
           "--tokenizer", json.dumps({"kind": "huggingface_auto", "model": str(model_dir.resolve())}),
           "--data", json.dumps({"kind": "json_file", "path": str(data)}), "--seed", "kind=static,value=0",
           "--output", json.dumps({"kind": "json", "path": str(out)}), "--disable-console"]
    log = work / f"guidellm-{tag}.log"
    with log.open("wb") as f:
        try:
            rc = subprocess.run(cmd, env={**os.environ, **CLIENT_ENV}, stdout=f, stderr=subprocess.STDOUT,
                                timeout=1800, cwd=REPO).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    if rc != 0 or not out.exists():
        raise RuntimeError(f"guidellm exited {rc} ({shlex.join(cmd)[:200]}...): "
                           f"{log.read_text(errors='replace')[-800:]}")
    row = parse(json.loads(out.read_text()))
    if row["failed"] or row["ttft_p50_s"] is None or not row["output_tok_s"]:
        raise RuntimeError(f"guidellm run {tag}: {row['ok']} ok, {row['failed']} failed: {row['errors'][:3]}")
    return row


def parse(doc: Mapping[str, Any]) -> dict[str, Any]:
    """GuideLLM's JSON output (one benchmark) as one row: requests ok / failed, TTFT p50 / p99 and ITL p50 in
    seconds, output tokens/s (GuideLLM's mean rate), median prompt tokens and the distinct errors."""
    b = doc["benchmarks"][0]
    m = b["metrics"]
    totals = m["request_totals"]
    errors = sorted({str((r.get("info") or {}).get("error") or "unknown").splitlines()[0][:200]
                     for r in b["requests"].get("errored") or []})
    row = {"ok": int(totals["successful"]), "failed": int(totals["errored"]) + int(totals["incomplete"]),
           "ttft_p50_s": _stat(m.get("time_to_first_token_ms"), "p50"),
           "ttft_p99_s": _stat(m.get("time_to_first_token_ms"), "p99"),
           "itl_p50_s": _stat(m.get("inter_token_latency_ms"), "p50"),
           "output_tok_s": _stat(m.get("output_tokens_per_second"), "mean"),
           "prompt_tokens_p50": _stat(m.get("prompt_token_count"), "p50"),
           "output_tokens_p50": _stat(m.get("output_token_count"), "p50"), "errors": errors}
    for k in ("ttft_p50_s", "ttft_p99_s", "itl_p50_s"):
        if row[k] is not None:
            row[k] /= 1e3
    return row


def plans(model_dir: Path, seed: int, repeats: int, load: Load, peer_mode: str) -> tuple[Any, Any]:
    """The two timing experiments (TTFT p50; seconds per output token) over the same GuideLLM runs."""
    from kvstate.lab.experiment import Experiment, Target

    settings = {"load": load.__dict__, "peer_mode": peer_mode, "client": "GuideLLM (.venv-guidellm), /v1/completions",
                "servers": {s: shlex.join(server_argv(s, model_dir, 0, peer_mode)[1:]) for s in SERVERS},
                "threads_per_server": 1, "dtype": "float32"}
    common = dict(axis="position", methods=METHODS, seeds=(seed,), tasks=("shared-prefix",),
                  lengths=(load.prefix_tokens,), repeats=repeats, kind="timing",
                  code=("lab/models/serve_peer.py", "serve", "prefix", "models"), models=(str(model_dir),),
                  settings=settings)
    ttft = Experiment(name="serve-real-peer-ttft", targets=(
        Target("cached TTFT p50 <= 1/2 uncached at a 2K shared prefix, c = 1 (real model, GuideLLM)",
               method("kvstate", 1), "ratio", 0.5, higher_is_better=False, against=method("kvstate-nocache", 1)),
        Target("cached TTFT p50 <= 1/2 uncached at a 2K shared prefix, c = 8 (real model, GuideLLM)",
               method("kvstate", 8), "ratio", 0.5, higher_is_better=False, against=method("kvstate-nocache", 8)),
        Target("kvstate TTFT p50 below transformers serve's, c = 1", method("kvstate", 1), "ratio", 1.0,
               higher_is_better=False, against=method("hf-serve", 1)),
        Target("kvstate TTFT p50 below transformers serve's, c = 8", method("kvstate", 8), "ratio", 1.0,
               higher_is_better=False, against=method("hf-serve", 8)),
    ), **common)  # type: ignore[arg-type]
    per_token = Experiment(name="serve-real-peer-per-token", targets=(
        Target("output tokens/s at c = 8 >= 3x c = 1 (kvstate; seconds per output token <= 1/3)",
               method("kvstate", 8), "ratio", 1 / 3, higher_is_better=False, against=method("kvstate", 1)),
        Target("kvstate output tokens/s above transformers serve's, c = 1", method("kvstate", 1), "ratio", 1.0,
               higher_is_better=False, against=method("hf-serve", 1)),
        Target("kvstate output tokens/s above transformers serve's, c = 8", method("kvstate", 8), "ratio", 1.0,
               higher_is_better=False, against=method("hf-serve", 8)),
    ), **common)  # type: ignore[arg-type]
    return ttft, per_token


def _log(msg: str) -> None:
    print(f"[serve_peer {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    from kvstate.errors import KVStateError
    from kvstate.lab.experiment import Cell, Measurement, check_out, run
    from kvstate.lab.models.cli import REAL_MODEL, missing_hint

    ap = argparse.ArgumentParser(prog="python -m kvstate.lab.models.serve_peer", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=REAL_MODEL)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--requests-c1", type=int, default=Load.requests_c1)
    ap.add_argument("--requests-c8", type=int, default=Load.requests_c8)
    ap.add_argument("--peer-mode", choices=("continuous-batching", "sequential"), default="continuous-batching")
    ap.add_argument("--workdir", type=Path, default=None, help="GuideLLM's files and the servers' logs (default: a "
                    "fresh temporary directory)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--overwrite", action="store_true")
    args = ap.parse_args(argv)
    if not (args.model / "config.json").is_file():
        print(f"error: {missing_hint(args.model)}", file=sys.stderr)
        return 2
    for exe, make in ((GUIDELLM, "make clients"), (PEER, "make peer")):
        if not exe.is_file():
            print(f"error: {exe.relative_to(REPO)} is missing; run `{make}`", file=sys.stderr)
            return 2
    load = Load(requests_c1=args.requests_c1, requests_c8=args.requests_c8)
    import tempfile

    from transformers import AutoTokenizer

    work = args.workdir or Path(tempfile.mkdtemp(prefix="kvstate-serve-peer-"))
    work.mkdir(parents=True, exist_ok=True)
    runs: dict[tuple[str, int], dict[str, Any]] = {}
    try:
        ttft_e, tok_e = plans(args.model, args.seed, args.repeats, load, args.peer_mode)
        check_out(ttft_e, args.out, overwrite=args.overwrite)
        check_out(tok_e, args.out, overwrite=args.overwrite)
        tokenizer = AutoTokenizer.from_pretrained(str(args.model))
        with ExitStack() as stack:
            urls: dict[str, str] = {}
            for s in SERVERS:
                port = _free_port()
                urls[s] = stack.enter_context(launch(s, server_argv(s, args.model, port, args.peer_mode), port,
                                                     work / f"server-{s}.log", {"OMP_NUM_THREADS": "1"}))
                _log(f"{s} up at {urls[s]}")
            names = {s: (str(args.model.resolve()) if s == "hf-serve" else args.model.name) for s in SERVERS}
            agree: dict[str, str] = {}
            for s in SERVERS:  # the servers' greedy replies to one prompt (they should agree)
                prefix, prompts = texts(tokenizer, args.seed, 0, load, 1)
                agree[s] = complete(urls[s], names[s], prefix + prompts[0], load.output_tokens)
            _log(f"greedy agreement: {len(set(agree.values())) == 1} ({ {s: t[:40] for s, t in agree.items()} })")

            def measure(cell: Cell) -> Measurement:
                server, c = split_method(cell.method)
                index = 1 + cell.repeat * len(METHODS) + METHODS.index(cell.method)
                n = load.requests(c)
                prefix, prompts = texts(tokenizer, args.seed, index, load, n + 1)
                data = work / f"data-{cell.method}-r{cell.repeat}.jsonl"
                write_dataset(data, prefix, prompts[1:], load)
                complete(urls[server], names[server], prefix + " " + prompts[0], 1)  # prime: untimed
                before = scrape(urls[server])
                row = guidellm(urls[server], names[server], args.model, data, c, n, load.output_tokens, work,
                               f"{cell.method}-r{cell.repeat}")
                after = scrape(urls[server])
                key = 'kvstate_tokens_total{kind="reused"}'  # prompt tokens restored from the prefix cache
                row["reused_tokens"] = after.get(key, 0.0) - before.get(key, 0.0) if key in after else None
                row["load_avg"] = os.getloadavg()[0]
                runs[(cell.method, cell.repeat)] = row
                _log(f"repeat {cell.repeat + 1} {cell.method}: TTFT p50 {row['ttft_p50_s'] * 1e3:.0f} ms, "
                     f"{row['output_tok_s']:.1f} out tok/s, reused {row['reused_tokens']}, load {row['load_avg']:.2f}")
                return Measurement([row["ttft_p50_s"]], {f"r{cell.repeat}": row})

            ttft_doc = run(ttft_e, measure, out=None)

            def per_token(cell: Cell) -> Measurement:
                return Measurement([1.0 / runs[(cell.method, cell.repeat)]["output_tok_s"]])

            tok_doc = run(tok_e, per_token, out=None)
    except (KVStateError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    result: dict[str, Any] = {k: ttft_doc[k] for k in ("experiment", "rows", "pooled", "decisions")}
    result["per_token"] = {k: tok_doc[k] for k in ("experiment", "rows", "decisions")}
    result["greedy_replies"] = agree
    result["servers_agree"] = len(set(agree.values())) == 1
    if args.out is not None:
        from kvstate.lab.cli_output import write_results

        write_results(args.out, result, ttft_doc["provenance"], overwrite=args.overwrite)
    for d in [*ttft_doc["decisions"], *tok_doc["decisions"]]:
        print(f"{d['label']}: {d['value']:.3f} {d['ci']} -> {d['status']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
