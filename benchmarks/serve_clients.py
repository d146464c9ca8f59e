"""Benchmark: `kvstate serve` under the standard load clients, GuideLLM and inference-perf, prefix cache on vs off.

Starts two servers on free loopback ports (``kvstate serve --model M`` and ``... --no-cache``, one thread
each) and drives each, one client run at a time, with

- GuideLLM (``.venv-guidellm``): streaming ``/v1/completions`` requests sharing one prefix
  (``--prefix-tokens`` 1,024, one prefix, ``--prompt-tokens`` 64 after it, ``--output-tokens`` 32), at the
  profiles ``sync`` (synchronous), ``c1 c4 c8 c16`` (concurrent streams) and ``poisson`` (one run per
  ``--rates`` value), ``--requests`` requests per profile (GuideLLM's ``max_requests`` constraint). The
  data is GuideLLM's own ``synthetic_text`` (``--guidellm-data synthetic``, faker text cut to length by
  the model's tokenizer) or ``vocab``: the same shape written as a JSONL file of words from the model's
  vocabulary (a word-level tokenizer such as ref-hybrid's maps most faker words to ``<unk>``, which decoding
  drops, so ``synthetic`` then sends far fewer tokens than asked: the ``prompt tok`` column shows it);
- inference-perf (``.venv-infperf``): ``data.type: shared_prefix`` (one system prompt of the same length,
  questions and outputs of the same lengths), api ``completion``, streaming, concurrent stages at the
  concurrency levels selected (``c1 c4 c8 c16``; ``sync`` counts as concurrency 1), ``--requests`` each.

Both clients write their own JSON; this script parses it and reports per client, server and profile:
requests ok / failed, TTFT p50 / p99, output tokens/s, inter-token latency p50, prompt tokens per request
(median, as the server's usage reported them when it did), and the distinct error messages. The ratios
the serving targets need, side by side from one run (GuideLLM; inference-perf's where its stages allow):
TTFT p50 cached / uncached at concurrency 1 and 8; output tokens/s at concurrency 8 / concurrency 1
(cached server); p99 TTFT at concurrency 8 / the median TTFT at concurrency 1 (cached server).

Usage: ``OMP_NUM_THREADS=1 python benchmarks/serve_clients.py [--model models/ref-hybrid] [--requests 32]
[--profiles sync c1 c4 c8 c16 poisson] [--rates 0.5 1 2] [--clients guidellm infperf]
[--guidellm-data synthetic|vocab] [--prefix-tokens 1024] [--prompt-tokens 64] [--output-tokens 32]
[--seed 1000] [--workdir DIR] [--out FILE]``; a smoke run: ``--requests 4 --profiles c1 c8 --rates 1``.
Progress and a table on stderr, one JSON line on stdout; ``--out`` appends the run, with provenance, to a
``kvstate-results/1`` file. Needs ``make clients``. Ignored: GuideLLM's chat endpoint, sampling (both
clients ask for ``ignore_eos`` greedy-length outputs), repeats (one run per cell; a client's own
percentiles are over its requests). The run records the serving targets as met / missed (one run, so
a ratio beside its bound decides) and ``os.getloadavg()`` before each client run and at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from kvstate.lab.provenance import Recorder, append_run

REPO = Path(__file__).resolve().parents[1]
MODEL = Path("models/ref-hybrid")
GUIDELLM = REPO / ".venv-guidellm" / "bin" / "guidellm"
INFPERF = REPO / ".venv-infperf" / "bin" / "inference-perf"
PROFILES = ("sync", "c1", "c4", "c8", "c16", "poisson")
CLIENT_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
              "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def log(msg: str) -> None:
    print(f"[serve_clients {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """``kvstate serve`` in a subprocess on a free loopback port, one thread, its stderr in a log file."""

    def __init__(self, model: Path, cache: bool, name: str, logs: Path, extra: list[str] | None = None,
                 threads: int = 1) -> None:
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = logs / f"server-{name}.log"
        env = os.environ | {"OMP_NUM_THREADS": str(threads)}
        cmd = [sys.executable, "-m", "kvstate.cli", "serve", "--model", str(model), "--port", str(self.port),
               *([] if cache else ["--no-cache"]), *(extra or [])]
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvstate serve ({name}) exited with {self.proc.returncode}: "
                                   f"{self.log_path.read_text(errors='replace')[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"kvstate serve ({name}) did not answer /health within 300 s")
            time.sleep(0.3)

    def model_name(self) -> str:
        return str(httpx.get(self.url + "/v1/models", timeout=10).json()["data"][0]["id"])

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()


def scrape(url: str) -> dict[str, float]:
    """The server's ``/metrics`` as ``{"name{labels}": value}`` (Prometheus text, comments dropped)."""
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def vocab_words(model: Path) -> list[str]:
    """The plain words of a word-level tokenizer (special ``<...>`` tokens left out)."""
    tok = json.loads((model / "tokenizer.json").read_text())["model"]
    if tok.get("type") != "WordLevel":
        raise ValueError(f"{model}/tokenizer.json: --guidellm-data vocab needs a WordLevel tokenizer, found "
                         f"{tok.get('type')!r}; use --guidellm-data synthetic")
    return [w for w in tok["vocab"] if not (w.startswith("<") and w.endswith(">"))]


def write_vocab_dataset(path: Path, model: Path, n: int, prefix: int, prompt: int, output: int, seed: int) -> None:
    """GuideLLM rows (columns ``prefix``, ``prompt``, ``output_tokens_count``): one shared prefix, fresh prompts."""
    words = vocab_words(model)
    rng = random.Random(seed)
    shared = " ".join(rng.choice(words) for _ in range(prefix))
    with path.open("w") as f:
        for _ in range(n):
            f.write(json.dumps({"prefix": shared, "prompt": " ".join(rng.choice(words) for _ in range(prompt)),
                                "prompt_tokens_count": prompt, "output_tokens_count": output}) + "\n")


def run_client(cmd: list[str], log_path: Path, timeout: float) -> int:
    log(f"  $ {shlex.join(cmd)[:300]}")
    with log_path.open("wb") as f:
        try:
            return subprocess.run(cmd, env=os.environ | CLIENT_ENV, stdout=f, stderr=subprocess.STDOUT,
                                  timeout=timeout, cwd=REPO).returncode
        except subprocess.TimeoutExpired:
            return 124


def tail(path: Path, n: int = 1500) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else ""


# --- GuideLLM ---------------------------------------------------------------------------------------------

def guidellm_runs(args: argparse.Namespace) -> list[tuple[str, dict[str, Any]]]:
    """(group name, profile config) per GuideLLM invocation the selected profiles need."""
    runs: list[tuple[str, dict[str, Any]]] = []
    if "sync" in args.profiles:
        runs.append(("sync", {"kind": "synchronous"}))
    streams = [int(p[1:]) for p in args.profiles if p.startswith("c")]
    if streams:
        runs.append(("concurrent", {"kind": "concurrent", "streams": streams}))
    if "poisson" in args.profiles:
        runs.append(("poisson", {"kind": "poisson", "rate": list(args.rates)}))
    return runs


def guidellm(server: Server, model_name: str, data: dict[str, Any], args: argparse.Namespace,
             work: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    backend = {"kind": "openai_http", "target": server.url, "model": model_name,
               "request_format": "/v1/completions", "timeout": args.request_timeout}
    for group, profile in guidellm_runs(args):
        out = work / f"guidellm-{server.name}-{group}.json"
        out.unlink(missing_ok=True)
        cmd = [str(args.guidellm), "run", "--backend", json.dumps(backend), "--profile", json.dumps(profile),
               "--constraint", f"kind=max_requests,count={args.requests}",
               "--tokenizer", json.dumps({"kind": "huggingface_auto", "model": str(args.model.resolve())}),
               "--data", json.dumps(data), "--seed", "kind=static,value=0",
               "--output", json.dumps({"kind": "json", "path": str(out)}), "--disable-console"]
        t0 = time.perf_counter()
        rc = run_client(cmd, work / f"guidellm-{server.name}-{group}.log", args.client_timeout)
        if rc != 0 or not out.exists():
            rows.append({"client": "guidellm", "server": server.name, "profile": group, "ok": 0, "failed": None,
                         "errors": [f"guidellm exited {rc}: {tail(work / f'guidellm-{server.name}-{group}.log')}"]})
            log(f"  guidellm {group} on {server.name}: FAILED (exit {rc}, no JSON); see {work}")
            continue
        new = [parse_guidellm(b, server.name) for b in json.loads(out.read_text())["benchmarks"]]
        if any("400 Bad Request" in e for r in new for e in r["errors"]):
            why = guidellm_400(server.url, model_name, args.output_tokens)
            for r in new:
                r["errors"] = [e + f" -- the server, to GuideLLM's body: {why}" if "400 Bad Request" in e else e
                               for e in r["errors"]]
        if any("503" in e for r in new for e in r["errors"]):
            streams = max([int(r["profile"][1:]) for r in new if r["profile"].startswith("c") and r["failed"]] or [16])
            prompt = json.loads((work / "guidellm-vocab.jsonl").read_text().splitlines()[0]) if (
                work / "guidellm-vocab.jsonl").exists() else {"prefix": "", "prompt": "the"}
            replies = probe_refusals(server.url, model_name, prompt["prefix"] + " " + prompt["prompt"], streams,
                                     args.output_tokens)
            for r in new:
                if any("503" in e for e in r["errors"]):
                    r["server_replies_probe"] = replies  # the same load again, the bodies verbatim
            log(f"  503 probe ({streams} streams): {replies}")
        rows += new
        log(f"  guidellm {group} on {server.name}: {time.perf_counter() - t0:.0f} s, "
            + ", ".join(f"{r['profile']} {r['ok']} ok / {r['failed']} failed" for r in new))
    return rows


def guidellm_400(url: str, model_name: str, max_tokens: int) -> str:
    """The server's 400 message for the body GuideLLM 0.8.1 sends to /v1/completions (its error record keeps only
    the status line): the fields of ``OpenAICompletionsRequestHandler.format``, read from its source."""
    body = {"model": model_name, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "max_tokens": max_tokens, "ignore_eos": True, "prompt": "the"}
    try:
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    except httpx.HTTPError as e:
        return f"(probe failed: {e})"
    if r.status_code != 400:
        return f"(probe answered {r.status_code})"
    try:
        return str(r.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return r.text[:300]


def probe_refusals(url: str, model_name: str, prompt: str, streams: int, max_tokens: int) -> dict[str, int]:
    """The server's non-200 replies (status and body, verbatim) to ``streams`` concurrent streaming requests of
    GuideLLM's shape, each stream sending its next request as soon as its last one ended, 3 requests each
    (GuideLLM's error record keeps only the status line, not the body)."""
    import concurrent.futures as cf

    body = {"model": model_name, "stream": True, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    seen: dict[str, int] = {}

    def one_stream() -> list[str]:
        got = []
        with httpx.Client(timeout=300) as c:
            for _ in range(3):
                with c.stream("POST", url + "/v1/completions", json=body) as r:
                    text = r.read().decode(errors="replace")
                    if r.status_code != 200:
                        got.append(f"HTTP {r.status_code}: {text.strip()}")
                    elif '"error"' in text:
                        got.append("HTTP 200, error event: " + next(x for x in text.splitlines() if '"error"' in x))
        return got

    with cf.ThreadPoolExecutor(streams) as ex:
        for got in ex.map(lambda _: one_stream(), range(streams)):
            for g in got:
                seen[g] = seen.get(g, 0) + 1
    return seen


def _profile_name(strategy: dict[str, Any]) -> str:
    kind = strategy.get("type_")
    if kind == "synchronous":
        return "sync"
    if kind == "concurrent":
        return f"c{strategy['streams']}"
    if kind in ("poisson", "constant", "async"):
        return f"{kind}@{strategy.get('rate')}"
    return str(kind)


def _stat(metric: dict[str, Any] | None, key: str) -> float | None:
    s = (metric or {}).get("successful") or {}
    if not s.get("count"):
        return None
    return float(s["percentiles"][key]) if key.startswith("p") and key != "mean" else float(s[key])


def parse_guidellm(b: dict[str, Any], server: str) -> dict[str, Any]:
    m = b["metrics"]
    totals = m["request_totals"]
    errors: dict[str, int] = {}
    for r in b["requests"].get("errored") or []:
        e = str((r.get("info") or {}).get("error") or "unknown").split("\\n")[0].split("\n")[0]
        e = e.split(" for url ")[0]  # the URL names a port: one message per kind of error
        errors[e] = errors.get(e, 0) + 1
    ttft50, ttft99 = _stat(m.get("time_to_first_token_ms"), "p50"), _stat(m.get("time_to_first_token_ms"), "p99")
    itl50 = _stat(m.get("inter_token_latency_ms"), "p50")
    prompt = (m.get("prompt_token_count") or {}).get("total") or {}
    return {
        "client": "guidellm", "server": server, "profile": _profile_name(b["config"]["strategy"]),
        "ok": int(totals["successful"]), "failed": int(totals["errored"]) + int(totals["incomplete"]),
        "ttft_p50_s": None if ttft50 is None else ttft50 / 1e3,
        "ttft_p99_s": None if ttft99 is None else ttft99 / 1e3,
        "output_tok_s": _stat(m.get("output_tokens_per_second"), "mean"),  # GuideLLM's headline rate
        "itl_p50_s": None if itl50 is None else itl50 / 1e3,
        "prompt_tokens_p50": prompt.get("median") if prompt.get("count") else None,
        "duration_s": b.get("duration"),
        "errors": [f"{n}x {e}" for e, n in errors.items()],
    }


# --- inference-perf ---------------------------------------------------------------------------------------

def infperf_levels(profiles: list[str]) -> list[int]:
    levels = sorted({int(p[1:]) for p in profiles if p.startswith("c")} | ({1} if "sync" in profiles else set()))
    return levels


def infperf(server: Server, model_name: str, args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    levels = infperf_levels(args.profiles)
    if not levels:
        return []
    out = work / f"infperf-{server.name}"
    config = {
        "api": {"type": "completion", "streaming": True},
        "data": {"type": "shared_prefix", "shared_prefix": {
            "num_groups": 1, "num_prompts_per_group": max(args.requests, 1),
            "system_prompt_len": args.prefix_tokens, "question_len": args.prompt_tokens,
            "output_len": args.output_tokens, "seed": args.seed}},
        "load": {"type": "concurrent", "interval": 0.5, "num_workers": 1,
                 "stages": [{"num_requests": args.requests, "concurrency_level": c} for c in levels],
                 "request_timeout": args.request_timeout},
        "server": {"type": "vllm", "model_name": model_name, "base_url": server.url, "ignore_eos": True},
        "tokenizer": {"pretrained_model_name_or_path": str(args.model.resolve())},
        "report": {"request_lifecycle": {"summary": True, "per_stage": True, "per_request": False}},
        "storage": {"local_storage": {"path": str(out)}},
    }
    cfg = work / f"infperf-{server.name}.json"  # YAML is a superset of JSON
    cfg.write_text(json.dumps(config, indent=1))
    t0 = time.perf_counter()
    rc = run_client([str(args.inference_perf), "-c", str(cfg)], work / f"infperf-{server.name}.log",
                    args.client_timeout)
    rows = []
    for i, c in enumerate(levels):
        stage = out / f"stage_{i}_lifecycle_metrics.json"
        if not stage.exists():
            rows.append({"client": "infperf", "server": server.name, "profile": f"c{c}", "ok": 0, "failed": None,
                         "errors": [f"inference-perf exited {rc}, no {stage.name}: "
                                    f"{tail(work / f'infperf-{server.name}.log')}"]})
            continue
        rows.append(parse_infperf(json.loads(stage.read_text()), server.name, f"c{c}"))
    log(f"  inference-perf on {server.name}: {time.perf_counter() - t0:.0f} s, exit {rc}, "
        + ", ".join(f"{r['profile']} {r['ok']} ok / {r['failed']} failed" for r in rows))
    return rows


def parse_infperf(d: dict[str, Any], server: str, profile: str) -> dict[str, Any]:
    s, f = d.get("successes") or {}, d.get("failures") or {}
    lat = s.get("latency") or {}
    ttft, itl = lat.get("time_to_first_token") or {}, lat.get("inter_token_latency") or {}
    prompt = s.get("prompt_tokens") or {}
    errors = []
    for label, v in (f.get("by_label") or {}).items():
        msgs = "; ".join(str(m.get("message")) for m in v.get("messages") or [])
        errors.append(f"{v.get('count')}x {label}: {msgs}")
    return {
        "client": "infperf", "server": server, "profile": profile,
        "ok": int(s.get("count") or 0), "failed": int(f.get("count") or 0),
        "ttft_p50_s": ttft.get("median"), "ttft_p99_s": ttft.get("p99"),
        "output_tok_s": (s.get("throughput") or {}).get("output_tokens_per_sec") if s.get("count") else None,
        "itl_p50_s": itl.get("median"),
        "prompt_tokens_p50": prompt.get("median"),
        "prompt_tokens_cached": prompt.get("cached"), "prompt_tokens_total": prompt.get("total"),
        "duration_s": d.get("benchmark_time_seconds"),
        "errors": errors,
    }


# --- ratios and table -------------------------------------------------------------------------------------

def ratios(rows: list[dict[str, Any]], client: str) -> dict[str, float | None]:
    def get(server: str, profile: str, key: str) -> float | None:
        for r in rows:
            if r["client"] == client and r["server"] == server and r["profile"] == profile and r["ok"]:
                return r.get(key)
        return None

    def div(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    return {
        "ttft_p50_cached_over_uncached_c1": div(get("cache", "c1", "ttft_p50_s"), get("no-cache", "c1", "ttft_p50_s")),
        "ttft_p50_cached_over_uncached_c8": div(get("cache", "c8", "ttft_p50_s"), get("no-cache", "c8", "ttft_p50_s")),
        "output_tok_s_c8_over_c1_cached": div(get("cache", "c8", "output_tok_s"), get("cache", "c1", "output_tok_s")),
        "ttft_p99_c8_over_p50_c1_cached": div(get("cache", "c8", "ttft_p99_s"), get("cache", "c1", "ttft_p50_s")),
    }


def _f(x: float | None, scale: float = 1.0, fmt: str = ".1f") -> str:
    return "-" if x is None else format(x * scale, fmt)


def table(rows: list[dict[str, Any]]) -> None:
    print(f"{'client':>8} {'server':>8} {'profile':>12} {'ok':>4} {'fail':>4} {'TTFT p50 ms':>11} {'p99 ms':>8} "
          f"{'out tok/s':>9} {'ITL p50 ms':>10} {'prompt tok':>10}", file=sys.stderr)
    for r in rows:
        print(f"{r['client']:>8} {r['server']:>8} {r['profile']:>12} {r['ok']:>4} {_f(r['failed'], 1, '.0f'):>4} "
              f"{_f(r.get('ttft_p50_s'), 1e3):>11} {_f(r.get('ttft_p99_s'), 1e3):>8} {_f(r.get('output_tok_s')):>9} "
              f"{_f(r.get('itl_p50_s'), 1e3, '.2f'):>10} {_f(r.get('prompt_tokens_p50'), 1, '.0f'):>10}",
              file=sys.stderr)
    errors = {e for r in rows for e in r.get("errors") or []}
    for r in rows:
        for e in r.get("errors") or []:
            if e in errors:
                print(f"  error ({r['client']}, {r['server']}, {r['profile']} and others alike): {e[:400]}",
                      file=sys.stderr)
                errors.discard(e)


TARGETS = (  # (name, ratio key, bound): the serving targets, each ratio <= its bound
    ("TTFT p50 cached <= 1/2 uncached, c1", "ttft_p50_cached_over_uncached_c1", 0.5),
    ("TTFT p50 cached <= 1/2 uncached, c8", "ttft_p50_cached_over_uncached_c8", 0.5),
    ("output tok/s c8 >= 3x c1 (cached)", "c1_over_c8_output_tok_s_cached", 1 / 3),
    ("TTFT p99 c8 <= 4x p50 c1 (cached)", "ttft_p99_c8_over_p50_c1_cached", 4.0),
)


def targets(rows: list[dict[str, Any]], summary: dict[str, dict[str, float | None]]) -> dict[str, Any]:
    """Met / missed per target and client (one run: no interval, so a ratio beside its bound decides it)."""
    failed = sum(r["failed"] or 0 for r in rows) + sum(1 for r in rows if r["failed"] is None)
    out: dict[str, Any] = {"0 failed requests in every run": {"value": failed, "status": "met" if failed == 0 else "missed"}}
    for name, key, bound in TARGETS:
        for client, rat in summary.items():
            if key == "c1_over_c8_output_tok_s_cached":
                v = rat.get("output_tok_s_c8_over_c1_cached")
                status = "undecided" if v is None else ("met" if v >= 3.0 else "missed")
            else:
                v = rat.get(key)
                status = "undecided" if v is None else ("met" if v <= bound else "missed")
            out[f"{name} [{client}]"] = {"value": v, "status": status}
    return out


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def client_version(exe: Path, package: str) -> str:
    py = exe.parent / "python"
    try:
        return subprocess.run([str(py), "-c", f"import importlib.metadata as m; print(m.version({package!r}))"],
                              capture_output=True, text=True, timeout=60, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "missing"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=MODEL)
    ap.add_argument("--requests", type=int, default=32, help="requests per profile (per stage for inference-perf)")
    ap.add_argument("--profiles", nargs="+", default=list(PROFILES), choices=PROFILES)
    ap.add_argument("--rates", nargs="+", type=float, default=[0.5, 1.0, 2.0], help="Poisson rates, requests/s")
    ap.add_argument("--clients", nargs="+", default=["guidellm", "infperf"], choices=["guidellm", "infperf"])
    ap.add_argument("--guidellm-data", choices=["synthetic", "vocab"], default="synthetic")
    ap.add_argument("--prefix-tokens", type=int, default=1024)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=1000, help="data seed (vocab prefix / prompts; inference-perf's)")
    ap.add_argument("--request-timeout", type=float, default=300.0, help="seconds, per request (both clients)")
    ap.add_argument("--client-timeout", type=float, default=1800.0, help="seconds, per client invocation")
    ap.add_argument("--guidellm", type=Path, default=GUIDELLM)
    ap.add_argument("--inference-perf", type=Path, default=INFPERF)
    ap.add_argument("--workdir", type=Path, default=None, help="keep the clients' outputs and logs here")
    ap.add_argument("--out", type=Path, default=None, help="append this run, with provenance, to a result file")
    args = ap.parse_args()
    for p, pkg, c in ((args.guidellm, "guidellm", "guidellm"), (args.inference_perf, "inference-perf", "infperf")):
        if c in args.clients and not p.exists():
            sys.exit(f"{p} is missing: run `make clients` (or pass --{pkg})")
    if args.requests < 1:
        sys.exit("--requests must be >= 1")
    versions = {"guidellm": client_version(args.guidellm, "guidellm"),
                "inference-perf": client_version(args.inference_perf, "inference-perf")}
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                if k not in ("out", "workdir", "guidellm", "inference_perf")} | {"client_versions": versions}
    rec = Recorder(code=("serve", "prefix", "models"), models=[args.model], n=args.requests, seeds=[args.seed],
                   tasks=[f"{c}:{p}" for c in args.clients for p in args.profiles],
                   lengths=[args.prefix_tokens, args.prompt_tokens, args.output_tokens], settings=settings)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="serve_clients-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.guidellm_data == "vocab":
        path = work / "guidellm-vocab.jsonl"
        write_vocab_dataset(path, args.model, max(args.requests * 4, 64), args.prefix_tokens, args.prompt_tokens,
                            args.output_tokens, seed=args.seed)
        data: dict[str, Any] = {"kind": "json_file", "path": str(path)}
    else:
        data = {"kind": "synthetic_text", "prefix_tokens": args.prefix_tokens, "prefix_count": 1,
                "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens}
    log(f"clients {versions}; outputs in {work}")
    servers: list[Server] = []
    rows: list[dict[str, Any]] = []
    load = {"start": loadavg()}
    try:
        for cache, name in ((True, "cache"), (False, "no-cache")):
            servers.append(Server(args.model, cache, name, work))
            log(f"server {name} up at {servers[-1].url}")
        names = {s.name: s.model_name() for s in servers}
        for s in servers:  # warm-up: first calls, allocator (fields today's server accepts)
            httpx.post(s.url + "/v1/completions", json={"model": names[s.name], "prompt": "the", "max_tokens": 2},
                       timeout=120)
        for client in args.clients:
            for s in servers:
                log(f"{client} -> {s.name} (load average {loadavg()})")
                load[f"{client}->{s.name}"] = loadavg()
                rows += (guidellm(s, names[s.name], data, args, work) if client == "guidellm"
                         else infperf(s, names[s.name], args, work))
    finally:
        for s in servers:
            s.stop()
    load["end"] = loadavg()
    table(rows)
    summary = {c: ratios(rows, c) for c in args.clients}
    for c, r in summary.items():
        print(f"{c}: " + ", ".join(f"{k} {_f(v, 1, '.3f')}" for k, v in r.items()), file=sys.stderr)
    verdicts = targets(rows, summary)
    for name, v in verdicts.items():
        print(f"target {name}: {_f(v['value'], 1, '.3f')} -> {v['status']}", file=sys.stderr)
    print(f"load average (1/5/15 min) {load}; {os.cpu_count()} CPUs", file=sys.stderr)
    want = args.prefix_tokens + args.prompt_tokens
    for r in rows:
        got = r.get("prompt_tokens_p50")
        if r["ok"] and not r["failed"] and got is not None and got < 0.5 * want:
            log(f"warning: {r['client']} {r['server']} {r['profile']} sent {got:.0f} prompt tokens per request, "
                f"not ~{want}: its text does not survive this tokenizer (try --guidellm-data vocab)")
            break
    failed = sum(r["failed"] or 0 for r in rows) + sum(1 for r in rows if r["failed"] is None)
    out = {"benchmark": "serve_clients", "model": str(args.model), "guidellm_data": args.guidellm_data,
           "guidellm_data_note": ("JSONL of words from the model's vocabulary, so the shared prefix reaches the server "
                                  "at full length (GuideLLM's synthetic text is mostly <unk> here)"
                                  if args.guidellm_data == "vocab" else "GuideLLM synthetic_text"),
           "requests": args.requests, "profiles": args.profiles, "rates": args.rates,
           "prefix_tokens": args.prefix_tokens, "prompt_tokens": args.prompt_tokens,
           "output_tokens": args.output_tokens, "client_versions": versions, "failed_requests_or_runs": failed,
           "ratios": summary, "targets": verdicts, "load_average": load, "cpus": os.cpu_count(),
           "seed": args.seed, "rows": rows, "workdir": str(work)}
    if args.out is not None:
        append_run(args.out, out, rec.finish())
    print(json.dumps(out))


if __name__ == "__main__":
    main()
