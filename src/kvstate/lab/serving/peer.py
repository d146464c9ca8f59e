"""``kvstate serve`` against HuggingFace's ``transformers serve`` over HTTP, one closed-loop client, c = 1 / 8 / 16.

Sparse prefix caching and continuous batching ("Sparse Prefix Caching for Hybrid and Recurrent LLM Serving";
Sarathi-Serve's chunked prefill, ``docs/techniques.md#serving-kvstate-serve``) measured where a user meets them:
three servers over HTTP on free local ports, one thread each, fp32 on the CPU, started once and driven one run at
a time —

- ``kvstate``: ``kvstate serve --model M`` at its defaults (prefix cache on, grid checkpoints, chunk 512);
- ``kvstate-nocache``: the same with ``--no-cache``;
- ``hf-serve``: ``transformers serve M`` from ``.venv-peer`` (``make peer``), with ``--continuous-batching`` on an
  attention-only model and sequential on a hybrid (its continuous batching refuses ``linear_attention`` layers:
  every request a 500) — :func:`peer_mode`.

The client is a closed loop (:func:`closed_loop`): ``c`` streams, each sending its next streaming
``/v1/completions`` request when its reply ends, greedy, at most ``--output-tokens`` tokens (no ``ignore_eos``,
which the peer refuses; a reply may end at EOS, the same on every server). Two workloads (tasks):
``shared-prefix`` (4 prefixes of ``--prefix-tokens`` in turn, each request a fresh ``--suffix-tokens`` tail; a
prefix's first visit is cold) and ``no-shared-prefix`` (every prompt fresh, the same length). Every server gets
the same prompts for a (task, repeat, concurrency), never seen by it before (no flush over HTTP is needed), and
the servers' order rotates between repeats (interleaved). Text: words of the model's vocabulary on a word-level
tokenizer (the reference models), licence prose (:mod:`kvstate.lab.workloads.realtext`) on a real one.

A method is a server at a concurrency (``kvstate@c8``). Five timing experiments per task read the same runs:
``ttft`` (TTFT p50), ``tail`` (TTFT p99 at c > 1, the median at c = 1: the issue's "p99 at c = 8 against c = 1's
median"), ``itl`` (median gap between a stream's consecutive tokens), ``per-token`` (seconds per output token: 1 /
output tokens/s) and ``rss`` (the server process's peak resident set during the run, sampled every 20 ms from
``/proc``); each run also records goodput (requests with TTFT <= 500 ms and mean ITL <= 50 ms) and, on
``shared-prefix``, the prompt tokens later visits restored (``usage.prompt_tokens_details.cached_tokens``). The
targets are issue 46's, committed with this module before the runs that decide them.

Run as a module (``make peer`` first)::

    OMP_NUM_THREADS=1 python -m kvstate.lab.serving.peer --model models/ref-attn --seed 1082 \\
        --out models/ref-attn/serve_peer.json

Ignored: chat requests (``kvstate.lab.models.exchange``), sampling, GuideLLM's own percentiles
(``kvstate.lab.models.serve_peer`` drives the real model with it).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstate.lab.serving import common

SERVERS = ("kvstate", "kvstate-nocache", "hf-serve")
CONCURRENCY = (1, 8, 16)
TASKS = ("shared-prefix", "no-shared-prefix")
PREFIXES = 4
RSS_POLL_S = 0.02
MODEL = Path("models/ref-attn")


def method(server: str, c: int) -> str:
    return f"{server}@c{c}"


def split_method(name: str) -> tuple[str, int]:
    server, _, c = name.rpartition("@c")
    return server, int(c)


@dataclass(frozen=True)
class Load:
    """One closed-loop run's shape (a frozen configuration)."""

    prefix_tokens: int = 1024
    suffix_tokens: int = 64
    output_tokens: int = 32
    requests_c1: int = 8
    requests_c8: int = 24
    requests_c16: int = 32

    def requests(self, c: int) -> int:
        return {1: self.requests_c1, 8: self.requests_c8}.get(c, self.requests_c16)


def peer_mode(model_dir: Path) -> str:
    """``sequential`` where the model has a layer that is not full attention (the peer's continuous batching refuses
    it), else ``continuous-batching``."""
    config = json.loads((model_dir / "config.json").read_text())
    kinds = set(config.get("layer_types") or ["full_attention"])
    return "continuous-batching" if kinds <= {"full_attention"} else "sequential"


def text_source(model_dir: Path, tokenizer: Any) -> Callable[[random.Random, int], str]:
    """``take(rng, n)``: a fresh text of about ``n`` tokens — vocabulary words on a word-level tokenizer (one token
    each; English prose would be ``<unk>``), licence prose cut by the tokenizer otherwise."""
    spec = json.loads((model_dir / "tokenizer.json").read_text())
    if spec["model"]["type"] == "WordLevel":
        words = [w for w in spec["model"]["vocab"] if not (w.startswith("<") and w.endswith(">")) and w.strip()]

        def take_words(rng: random.Random, n: int) -> str:
            return " ".join(rng.choice(words) for _ in range(n))

        return take_words
    from kvstate.lab.workloads import realtext

    sentences = realtext.haystack()

    def take_prose(rng: random.Random, n: int) -> str:
        j, ids = rng.randrange(len(sentences)), []
        while len(ids) < n:
            ids += tokenizer(" " + sentences[j % len(sentences)], add_special_tokens=False)["input_ids"]
            j += 1
        return str(tokenizer.decode(ids[:n]))

    return take_prose


def prompts(take: Callable[[random.Random, int], str], task: str, n: int, load: Load, rng: random.Random
            ) -> list[str]:
    """``n`` prompts of about ``prefix + suffix`` tokens: on ``shared-prefix`` request ``i`` uses prefix ``i % 4``."""
    heads = [take(rng, load.prefix_tokens) for _ in range(PREFIXES)]
    return [(heads[i % PREFIXES] if task == "shared-prefix" else take(rng, load.prefix_tokens)) + " "
            + take(rng, load.suffix_tokens) for i in range(n)]


def sse_events(lines: Sequence[str]) -> list[dict[str, Any]]:
    """The JSON events of a server-sent-event stream's lines (``data: {...}``; ``[DONE]`` and other lines skipped)."""
    out = []
    for line in lines:
        if line.startswith("data:"):
            body = line[5:].strip()
            if body and body != "[DONE]":
                out.append(json.loads(body))
    return out


async def one_request(client: Any, url: str, model: str, prompt: str, max_tokens: int, usage: bool
                      ) -> dict[str, Any]:
    """One streaming completion: its start, end, time to first text, gaps between text events, reply tokens (text
    events) and the prompt tokens the server says it restored (0 where it does not say)."""
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                            "stream": True}
    if usage:
        body["stream_options"] = {"include_usage": True}
    t0 = time.perf_counter()
    marks: list[float] = []
    reused = 0
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url} answered {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            for ev in sse_events([line]):
                if any(ch.get("text") for ch in ev.get("choices") or []):
                    marks.append(time.perf_counter())
                details = (ev.get("usage") or {}).get("prompt_tokens_details") or {}
                reused = int(details.get("cached_tokens") or reused)
    end = time.perf_counter()
    return {"start": t0, "end": end, "ttft": (marks[0] if marks else end) - t0,
            "gaps": [b - a for a, b in itertools.pairwise(marks)], "tokens": len(marks), "reused": reused}


async def closed_loop(url: str, model: str, batch: Sequence[str], c: int, max_tokens: int, usage: bool,
                      transport: Any = None) -> list[dict[str, Any]]:
    """Send ``batch`` in order through ``c`` streams, each its next request when its reply ends (``transport``: an
    httpx transport in place of the network, for tests)."""
    import httpx

    todo = list(enumerate(batch))
    done: list[dict[str, Any]] = [{} for _ in batch]
    async with httpx.AsyncClient(timeout=1800, transport=transport) as client:
        async def stream() -> None:
            while todo:
                i, prompt = todo.pop(0)
                done[i] = await one_request(client, url, model, prompt, max_tokens, usage)

        await asyncio.gather(*(stream() for _ in range(c)))
    return done


def rss_bytes(pid: int) -> int:
    """A process's resident set now (``VmRSS`` of ``/proc/PID/status``), 0 when it cannot be read."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class RssPeak:
    """The largest resident set of a process while the ``with`` block runs (polled every :data:`RSS_POLL_S`)."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak = pid, rss_bytes(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.wait(RSS_POLL_S):
            self.peak = max(self.peak, rss_bytes(self.pid))

    def __enter__(self) -> RssPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes(self.pid))


@contextmanager
def launch(name: str, argv: Sequence[str], log: Path) -> Iterator[tuple[str, int]]:
    """Start a server (one thread), wait until ``/v1/models`` answers; yield its URL and pid; stop it on exit."""
    import os
    import subprocess

    import httpx

    from kvstate.lab.models.serve_peer import START_TIMEOUT_S

    port = int(argv[argv.index("--port") + 1])
    with open(log, "wb") as out:
        proc = subprocess.Popen(list(argv), stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
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
        yield url, proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def plans(model_dir: Path, seed: int, repeats: int, load: Load, concurrency: Sequence[int], tasks: Sequence[str],
          mode: str) -> tuple[Any, dict[str, tuple[Any, ...]]]:
    """The whole run (its provenance and seed-ledger entry) and, per task, the five timing experiments over the
    same runs, each with issue 46's targets where its methods are measured (committed before the runs)."""
    from kvstate.lab.experiment import Experiment, Target
    from kvstate.lab.models.serve_peer import server_argv

    methods = tuple(method(s, c) for c in concurrency for s in SERVERS)
    settings = {"load": load.__dict__, "peer_mode": mode, "client": "closed loop over HTTP, streaming /v1/completions",
                "servers": {s: " ".join(server_argv(s, model_dir, 0, mode)[1:]) for s in SERVERS},
                "threads_per_server": 1, "dtype": "float32",
                "goodput": {"ttft_s": _slo()[0], "itl_s": _slo()[1]}}
    code = ("lab/serving/peer.py", "lab/models/serve_peer.py", "serve", "prefix", "models")
    whole = Experiment(name="serve-peer", axis="position", methods=methods, seeds=(seed,), tasks=tuple(tasks),
                       lengths=(load.prefix_tokens,), repeats=repeats, kind="timing", code=code,
                       models=(str(model_dir),), settings=settings)
    has = set(methods)

    def t(label: str, m: str, ratio: float, against: str) -> tuple[Any, ...]:
        return (Target(label, m, "ratio", ratio, higher_is_better=False, against=against),) if {m, against} <= has \
            else ()

    out = {}
    for task in tasks:
        common_ = dict(axis="position", methods=methods, seeds=(seed,), tasks=(task,), lengths=(load.prefix_tokens,),
                       repeats=repeats, kind="timing", code=code, models=(str(model_dir),), settings=settings)
        shared = task == "shared-prefix"
        k1, k8, p1, p8 = method("kvstate", 1), method("kvstate", 8), method("hf-serve", 1), method("hf-serve", 8)
        ttft = (*t(f"{task}: kvstate TTFT p50 <= transformers serve's, c = 1", k1, 1.0, p1),
                *t(f"{task}: kvstate TTFT p50 <= transformers serve's, c = 8", k8, 1.0, p8))
        tail = t(f"{task}: TTFT p99 at c = 8 <= 4x c = 1's median (kvstate)", k8, 4.0, k1) if shared else ()
        itl = t(f"{task}: ITL p50 at c = 8 <= 2.5x c = 1's (kvstate)", k8, 2.5, k1) if shared else ()
        per_token = ((*t(f"{task}: output tokens/s at c = 8 >= 3x c = 1 (kvstate; seconds per token <= 1/3)",
                         k8, 1 / 3, k1),) if shared else ()) + (
            *t(f"{task}: kvstate output tokens/s >= transformers serve's, c = 1", k1, 1.0, p1),
            *t(f"{task}: kvstate output tokens/s >= transformers serve's, c = 8", k8, 1.0, p8))
        rss = t(f"{task}: kvstate peak RSS <= 1.3x transformers serve's, c = 8", k8, 1.3, p8)
        out[task] = tuple(Experiment(name=f"serve-peer-{what}-{task}", targets=targets, **common_)  # type: ignore[arg-type]
                          for what, targets in (("ttft", ttft), ("tail", tail), ("itl", itl),
                                                ("per-token", per_token), ("rss", rss)))
    return whole, out


def _slo() -> tuple[float, float]:
    from kvstate.lab.serving.stall import ITL_SLO_S, TTFT_SLO_S

    return TTFT_SLO_S, ITL_SLO_S


def _log(msg: str) -> None:
    print(f"[serve-peer {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (``--out`` appends the run with its provenance); 2 on bad input."""
    from kvstate.errors import KVStateError
    from kvstate.lab.experiment import check_out
    from kvstate.lab.models.serve_peer import PEER, REPO

    ap = argparse.ArgumentParser(prog="python -m kvstate.lab.serving.peer", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=MODEL)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--concurrency", type=int, nargs="+", choices=CONCURRENCY, default=list(CONCURRENCY))
    ap.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS))
    ap.add_argument("--requests-c1", type=int, default=Load.requests_c1)
    ap.add_argument("--requests-c8", type=int, default=Load.requests_c8)
    ap.add_argument("--requests-c16", type=int, default=Load.requests_c16)
    ap.add_argument("--prefix-tokens", type=int, default=Load.prefix_tokens)
    ap.add_argument("--suffix-tokens", type=int, default=Load.suffix_tokens)
    ap.add_argument("--output-tokens", type=int, default=Load.output_tokens)
    ap.add_argument("--workdir", type=Path, default=None, help="the servers' logs (default: a fresh temporary "
                    "directory)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--overwrite", action="store_true")
    args = ap.parse_args(argv)
    if common.missing_model(args.model):
        return 2
    if not PEER.is_file():
        print(f"error: {PEER.relative_to(REPO)} is missing; run `make peer`", file=sys.stderr)
        return 2
    for name in ("requests_c1", "requests_c8", "requests_c16", "prefix_tokens", "suffix_tokens", "output_tokens"):
        if getattr(args, name) < 1:
            print(f"error: --{name.replace('_', '-')} {getattr(args, name)}: must be >= 1", file=sys.stderr)
            return 2
    load = Load(args.prefix_tokens, args.suffix_tokens, args.output_tokens, args.requests_c1, args.requests_c8,
                args.requests_c16)
    try:
        whole, plan = plans(args.model, args.seed, args.repeats, load, sorted(args.concurrency), args.tasks,
                            peer_mode(args.model))
        check_out(whole, args.out, overwrite=args.overwrite)
        result = measure_all(args.model, args.seed, load, whole, plan, args.workdir)
    except (KVStateError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return common.finish(args.out, result, args.overwrite)


def measure_all(model_dir: Path, seed: int, load: Load, whole: Any, plan: dict[str, tuple[Any, ...]],
                workdir: Path | None) -> dict[str, Any]:
    """Start the three servers, check their greedy replies agree, then per task run every cell of the TTFT
    experiment (the closed-loop runs) and decide the other four on the same runs; one document."""
    import tempfile
    from dataclasses import asdict

    from transformers import AutoTokenizer

    from kvstate.lab.experiment import Measurement, recorder, run
    from kvstate.lab.models.serve_peer import _free_port, complete, server_argv
    from kvstate.lab.serving.stall import goodput, later_visits, summarize

    rec = recorder(whole)
    mode = whole.settings["peer_mode"]
    work = workdir or Path(tempfile.mkdtemp(prefix="kvstate-serve-peer-"))
    work.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    take = text_source(model_dir, tokenizer)
    runs: dict[tuple[str, str, int], dict[str, Any]] = {}
    with ExitStack() as stack:
        urls, pids = {}, {}
        for s in SERVERS:
            urls[s], pids[s] = stack.enter_context(launch(s, server_argv(s, model_dir, _free_port(), mode),
                                                          work / f"server-{s}.log"))
            _log(f"{s} up at {urls[s]} (pid {pids[s]})")
        names = {s: (str(model_dir.resolve()) if s == "hf-serve" else model_dir.name) for s in SERVERS}
        probe = prompts(take, "no-shared-prefix", 1, load, random.Random(f"{seed}/agree"))[0]
        agree = {s: complete(urls[s], names[s], probe, load.output_tokens) for s in SERVERS}  # also each one's warm-up
        _log(f"greedy agreement: {len(set(agree.values())) == 1}")

        def measure(cell: Any) -> Any:
            server, c = split_method(cell.method)
            rng = random.Random(f"{seed}/{cell.task}/{cell.repeat}/{c}")  # the same prompts for every server
            batch = prompts(take, cell.task, load.requests(c), load, rng)
            with RssPeak(pids[server]) as rss:
                reqs = asyncio.run(closed_loop(urls[server], names[server], batch, c, load.output_tokens,
                                               usage=server != "hf-serve"))
            row = summarize(reqs, cell.task, load)
            row["peak_rss_bytes"] = rss.peak
            runs[(cell.method, cell.task, cell.repeat)] = row
            _log(f"repeat {cell.repeat + 1} {cell.task} {cell.method}: TTFT p50 {1e3 * row['ttft_p50_s']:.0f} / "
                 f"p99 {1e3 * row['ttft_p99_s']:.0f} ms, ITL p50 {1e3 * (row['itl_p50_s'] or 0):.1f} ms, "
                 f"{row['output_tok_s']:.1f} tok/s, goodput {row['goodput']:.2f}, RSS {rss.peak / 2**20:.0f} MiB")
            return Measurement([row["ttft_p50_s"]], {f"r{cell.repeat}": row})

        def reads(key: Callable[[dict[str, Any], int], float]) -> Callable[[Any], Any]:
            def one(cell: Any) -> Any:
                return Measurement([key(runs[(cell.method, cell.task, cell.repeat)], split_method(cell.method)[1])])
            return one

        readers = (reads(lambda r, c: r["ttft_p99_s"] if c > 1 else r["ttft_p50_s"]),
                   reads(lambda r, c: r["itl_p50_s"] if r["itl_p50_s"] is not None else float("nan")),
                   reads(lambda r, c: 1.0 / r["output_tok_s"]), reads(lambda r, c: float(r["peak_rss_bytes"])))
        docs = {}
        for task, (first, *rest) in plan.items():
            docs[task] = [run(first, measure, out=None, progress=True),
                          *(run(e, f, out=None) for e, f in zip(rest, readers, strict=True))]
    doc: dict[str, Any] = {"experiment": {**asdict(whole), "settings": dict(whole.settings)},
                           "rows": [r for d in docs.values() for r in d[0]["rows"]], "pooled": None,
                           "decisions": [x for d in docs.values() for e in d for x in e["decisions"]],
                           "experiments": {d["experiment"]["name"]: {k: d[k] for k in ("experiment", "rows")}
                                           for ds in docs.values() for d in ds},
                           "goodput": goodput(runs), "later_visits": later_visits(runs),
                           "greedy_replies": agree, "servers_agree": len(set(agree.values())) == 1}
    return {"doc": doc, "provenance": rec.finish()}


if __name__ == "__main__":
    sys.exit(main())
