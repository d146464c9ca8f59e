"""Benchmark: what a 20 MB request body costs ``kvstate serve`` — the time to refuse it, other clients' streams,
and the server's memory.

Starts ``kvstate serve --model models/ref-hybrid`` (a subprocess, one thread, the default ``--max-body-bytes``)
and measures, after a warm-up request:

- RSS (``VmRSS`` of the server process, from ``/proc/PID/status``) before and after ``--bodies`` 20 MB bodies
  sent one after another, and at the end of the run;
- per repeat: the time to refuse one 20 MB body as a client that sends it all before reading (``httpx``), and
  as one that reads while still sending (a raw socket: headers and the first 64 KiB);
- per repeat, interleaved (which goes first rotates): one streamed completion's median gap between tokens
  alone, while another client (a process of its own) sends 20 MB bodies to the server back to back, and, the
  control, while that client sends them to a sink that answers 413 without a model (what the flooding client's
  own CPU costs the stream on a small machine, whatever the server does).

Reported: medians over repeats with their min–max spread, and the ratios of the gaps (with / without).
Targets: refused in < 1 s; the gap within 2x; RSS after the bodies within 10 % of before. Prints progress and
a table on stderr and one JSON line on stdout; ``--out FILE`` appends the run with its provenance
(:mod:`kvstate.lab.provenance`). Usage: ``python benchmarks/serve_front_door.py [--model models/ref-hybrid]
[--repeats 5] [--bodies 10] [--body-mb 20] [--max-tokens 64] [--out models/ref-hybrid/serve_front_door.json]``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from kvstate.lab.provenance import Recorder, append_run

MODEL = Path("models/ref-hybrid")
PROMPTS = ["the", "once upon a time", "in the beginning", "a", "it was"]  # the first one that streams long wins


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """``kvstate serve`` in a subprocess on a free loopback port."""

    def __init__(self, model: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        self.cmd = [sys.executable, "-m", "kvstate.cli", "serve", "--model", str(model), "--port", str(self.port)]
        self.proc = subprocess.Popen(self.cmd, env=env)
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

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS in /proc/PID/status")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def big_body(model_id: str, mb: int) -> bytes:
    """A completion request of about ``mb`` MB: a prompt of repeated words."""
    head, tail = f'{{"model": "{model_id}", "max_tokens": 1, "prompt": "'.encode(), b'"}'
    return head + b"word " * ((mb * 1_000_000 - len(head) - len(tail)) // 5) + tail


def refuse_httpx(url: str, body: bytes) -> float:
    """Seconds to the answer of a client that sends the whole body, then reads."""
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/completions", content=body, headers={"content-type": "application/json"}, timeout=120)
    elapsed = time.perf_counter() - t0
    if r.status_code != 413:
        raise RuntimeError(f"a {len(body):,}-byte body got {r.status_code}, not 413: {r.text[:200]}")
    return elapsed


def refuse_early(port: int, size: int) -> float:
    """Seconds to the status line for a client that declares ``size`` bytes, sends 64 KiB of them and reads."""
    t0 = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {size}\r\n\r\n".encode() + b" " * 65536)
        data = b""
        while b"\r\n" not in data:
            chunk = s.recv(4096)
            if not chunk:
                break
            data += chunk
    elapsed = time.perf_counter() - t0
    if not data.startswith(b"HTTP/1.1 413"):
        raise RuntimeError(f"a declared {size:,}-byte body got {data[:40]!r}, not 413")
    return elapsed


def stream(url: str, model_id: str, prompt: str, max_tokens: int) -> list[float]:
    """Arrival times (s) of each text delta of one streamed completion."""
    body = {"model": model_id, "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    times: list[float] = []
    with httpx.Client(timeout=120) as c, c.stream("POST", url + "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                times.append(time.perf_counter())
    return times


def median_gap(times: list[float]) -> float:
    gaps = [b - a for a, b in itertools.pairwise(times)]
    if not gaps:
        raise RuntimeError("the stream sent fewer than two text deltas")
    return statistics.median(gaps)


def _flood(url: str, body: bytes, done: Any, sent: Any, failed: Any) -> None:
    while not done.is_set():
        try:
            refuse_httpx(url, body)
            counter = sent
        except (httpx.HTTPError, RuntimeError):  # not a 413: counted and reported
            counter = failed
        with counter.get_lock():
            counter.value += 1


def _sink(sock: socket.socket) -> None:
    """The control's target: answers each request's headers with a 413 and closes, as the server does, no model."""
    reply = b"HTTP/1.1 413 Payload Too Large\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}"
    while True:
        conn, _ = sock.accept()
        with conn:
            data = b""
            while b"\r\n\r\n" not in data and (chunk := conn.recv(65536)):
                data += chunk
            conn.sendall(reply)


def gap_with_bodies(url: str, model_id: str, prompt: str, max_tokens: int, body: bytes,
                    target: str | None = None) -> tuple[float, int, int]:
    """The stream's median gap while another client (a process of its own) sends 20 MB bodies back to back to the
    server (or to ``target``), and how many of them were refused 413 and how many failed otherwise."""
    ctx = multiprocessing.get_context("fork")
    done, sent, failed = ctx.Event(), ctx.Value("i", 0), ctx.Value("i", 0)
    flood = ctx.Process(target=_flood, args=(target or url, body, done, sent, failed), daemon=True)
    flood.start()
    deadline = time.monotonic() + 30
    while sent.value + failed.value < 1 and time.monotonic() < deadline:  # the flood is under way
        time.sleep(0.005)
    try:
        gap = median_gap(stream(url, model_id, prompt, max_tokens))
    finally:
        done.set()
        flood.join(120)
    return gap, int(sent.value), int(failed.value)


def spread(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=MODEL)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--bodies", type=int, default=10)
    p.add_argument("--body-mb", type=int, default=20)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--out", type=Path, default=None, help="append the run, with its provenance, to this file")
    a = p.parse_args()
    rec = Recorder(code=("serve",), models=[a.model], n=a.repeats,
                   settings={"bodies": a.bodies, "body_mb": a.body_mb, "max_tokens": a.max_tokens,
                             "threads": os.environ.get("OMP_NUM_THREADS", "1")})
    model_id = a.model.resolve().name
    body = big_body(model_id, a.body_mb)
    sink_socket = socket.create_server(("127.0.0.1", 0))
    sink = multiprocessing.get_context("fork").Process(target=_sink, args=(sink_socket,), daemon=True)
    sink.start()
    sink_url = f"http://127.0.0.1:{sink_socket.getsockname()[1]}"
    server = Server(a.model)
    try:
        # warm up, and pick a prompt whose greedy reply streams the longest
        lengths = {q: len(stream(server.url, model_id, q, a.max_tokens)) for q in PROMPTS}
        prompt = max(PROMPTS, key=lambda q: lengths[q])
        refuse_httpx(server.url, body)
        print(f"warm: prompt {prompt!r} streams {lengths[prompt]} deltas", file=sys.stderr)
        rss_before = server.rss_bytes()
        for i in range(a.bodies):
            refuse_httpx(server.url, body)
            print(f"body {i + 1}/{a.bodies} refused", file=sys.stderr)
        rss_after = server.rss_bytes()
        refuse_s, early_s, alone, loaded, control, flood_bodies, flood_failed = [], [], [], [], [], [], []
        for r in range(a.repeats):
            refuse_s.append(refuse_httpx(server.url, body))
            early_s.append(refuse_early(server.port, len(body)))
            conditions = ["alone", "loaded", "control"]
            for which in conditions[r % 3:] + conditions[: r % 3]:  # each goes first in turn
                if which == "alone":
                    alone.append(median_gap(stream(server.url, model_id, prompt, a.max_tokens)))
                elif which == "loaded":
                    gap, n, bad = gap_with_bodies(server.url, model_id, prompt, a.max_tokens, body)
                    loaded.append(gap)
                    flood_bodies.append(n)
                    flood_failed.append(bad)
                else:
                    control.append(gap_with_bodies(server.url, model_id, prompt, a.max_tokens, body, sink_url)[0])
            print(f"repeat {r + 1}/{a.repeats}: refused in {refuse_s[-1]:.3f} s ({early_s[-1]:.4f} s reading early); "
                  f"gap {alone[-1] * 1e3:.1f} ms alone, {loaded[-1] * 1e3:.1f} ms with {flood_bodies[-1]} bodies, "
                  f"{control[-1] * 1e3:.1f} ms with bodies sent elsewhere", file=sys.stderr)
        rss_end = server.rss_bytes()
    finally:
        server.close()
        sink.kill()
    ratios = [x / y for x, y in zip(loaded, alone, strict=True)]
    result = {
        "benchmark": "serve_front_door",
        "model": str(a.model),
        "server": f"kvstate serve --model {a.model} (default --max-body-bytes)",
        "repeats": a.repeats,
        "body_bytes": len(body),
        "refuse_s": spread(refuse_s),
        "refuse_reading_early_s": spread(early_s),
        "stream_deltas": lengths[prompt],
        "gap_alone_s": spread(alone),
        "gap_with_bodies_s": spread(loaded),
        "gap_ratio": statistics.median(loaded) / statistics.median(alone),
        "gap_ratio_per_repeat": spread(ratios),
        # the same flood sent to a sink that answers 413 without a model: what the flooding client's own CPU costs
        # the stream on this machine, whatever the server does
        "gap_control_s": spread(control),
        "gap_ratio_control": statistics.median(control) / statistics.median(alone),
        "bodies_during_stream": spread([float(n) for n in flood_bodies]),
        "bodies_during_stream_not_413": sum(flood_failed),  # the flooding client saw an error instead of the 413
        "rss_before_bytes": rss_before,
        "rss_after_bodies_bytes": rss_after,
        "rss_bodies": a.bodies,
        "rss_ratio": rss_after / rss_before,
        "rss_end_bytes": rss_end,
        "bodies_total": 1 + a.bodies + 2 * a.repeats + sum(flood_bodies) + sum(flood_failed),
        "targets": {
            "refused_under_1s": statistics.median(refuse_s) < 1.0,
            "gap_within_2x": statistics.median(loaded) / statistics.median(alone) <= 2.0,
            "rss_within_10pct": abs(rss_after / rss_before - 1) <= 0.10,
        },
    }
    prov = rec.finish()
    if a.out is not None:
        append_run(a.out, result, prov)
    mib = 1 << 20
    print(f"{'measure':<38} {'median':>10} {'min':>10} {'max':>10}", file=sys.stderr)
    for name, unit, scale, s in (("refuse 20 MB (client sends it all)", "s", 1, result["refuse_s"]),
                                 ("refuse 20 MB (client reads early)", "s", 1, result["refuse_reading_early_s"]),
                                 ("stream gap alone", "ms", 1e3, result["gap_alone_s"]),
                                 ("stream gap with 20 MB bodies", "ms", 1e3, result["gap_with_bodies_s"]),
                                 ("stream gap, bodies sent elsewhere", "ms", 1e3, result["gap_control_s"])):
        print(f"{name + ' (' + unit + ')':<38} {s['median'] * scale:>10.4f} {s['min'] * scale:>10.4f} "
              f"{s['max'] * scale:>10.4f}", file=sys.stderr)
    print(f"gap ratio {result['gap_ratio']:.2f}x (control {result['gap_ratio_control']:.2f}x); RSS {rss_before / mib:.1f} MiB before, {rss_after / mib:.1f} MiB "
          f"after {a.bodies} bodies ({result['rss_ratio']:.3f}x), {rss_end / mib:.1f} MiB after "
          f"{result['bodies_total']} in all; targets {result['targets']}", file=sys.stderr)
    print(json.dumps({**result, "provenance": prov}))


if __name__ == "__main__":
    main()
