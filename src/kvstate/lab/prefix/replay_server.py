"""Replay a request trace through a running ``kvstate serve`` with the ``openai`` client: time to first token.

Sparse prefix caching ("Sparse Prefix Caching for Hybrid and Recurrent LLM Serving") measured where it
is used: each request of the trace is sent as a streaming ``/v1/completions`` call with its token ids as
the prompt, and the time from sending to the first streamed chunk is recorded. With a second server (the
same model with the cache off, ``kvstate serve --no-cache``) every request goes to both, the order
alternating, so the two are timed interleaved on the same machine state; the prefix cache's reuse is
read off the server's ``/metrics`` before and after.

Ignores: concurrency (one request in flight at a time), sampling (``max_tokens`` greedy tokens).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from kvstate.errors import KVStateError
from kvstate.lab.workloads.traces import Request


@dataclass(frozen=True)
class ServerReplayResult:
    server: str
    baseline_server: str | None
    requests: int
    tokens_total: int
    ttft_s_median: float  # time to first token through `server`
    ttft_s_median_baseline: float  # the same through `baseline_server` (nan without one)
    ttft_ratio: float  # median over requests of baseline / cached time to first token
    tokens_reused: float  # the server's prefix-cache counter, this replay's share (nan if not exported)
    per_request: list[dict[str, float]] = field(default_factory=list, repr=False)

    def as_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("per_request")
        return d


def _client(url: str) -> Any:
    from openai import OpenAI

    base = url.rstrip("/")
    return OpenAI(base_url=base if base.endswith("/v1") else base + "/v1", api_key="unused", max_retries=0)


def _reused(url: str) -> float:
    """The server's ``kvstate_prefix_reused_tokens`` counter from ``/metrics`` (nan when it exports none)."""
    import httpx

    base = url.rstrip("/").removesuffix("/v1")
    try:
        text = httpx.get(base + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return float("nan")
    for line in text.splitlines():
        if line.startswith("kvstate_prefix_reused_tokens"):
            return float(line.rsplit(" ", 1)[-1])
    return float("nan")


def _ttft(client: Any, model: str, tokens: list[int], max_tokens: int) -> float:
    t0 = time.perf_counter()
    stream = client.completions.create(model=model, prompt=tokens, max_tokens=max_tokens, stream=True)
    first = None
    for _chunk in stream:
        if first is None:
            first = time.perf_counter() - t0
    if first is None:
        raise KVStateError("the server streamed no chunk; check that it serves /v1/completions with stream=true.")
    return first


def replay_server(
    url: str,
    requests: Iterable[Request],
    *,
    baseline_url: str | None = None,
    max_tokens: int = 1,
    progress: Callable[[int], None] | None = None,
) -> ServerReplayResult:
    """Send every request to ``url`` (and ``baseline_url``), one at a time; see the module docstring."""
    reqs = list(requests)
    if any(r.tokens is None for r in reqs):
        raise KVStateError("--server replays need token ids in every request of the trace.")
    clients = {url: _client(url)} | ({baseline_url: _client(baseline_url)} if baseline_url else {})
    try:
        models = {u: c.models.list().data[0].id for u, c in clients.items()}
    except Exception as exc:
        raise KVStateError(f"cannot reach the server ({exc}); start it with `kvstate serve --model DIR`.") from None
    before = _reused(url)
    rows: list[dict[str, float]] = []
    for i, r in enumerate(reqs):
        toks = list(r.tokens or ())
        order = [url, baseline_url] if i % 2 == 0 else [baseline_url, url]
        row: dict[str, float] = {"length": float(len(toks))}
        for u in order:
            if u is not None:
                row["ttft_s" if u == url else "ttft_s_baseline"] = _ttft(clients[u], models[u], toks, max_tokens)
        rows.append(row)
        if progress is not None:
            progress(1)
    after = _reused(url)
    cached = [row["ttft_s"] for row in rows]
    base = [row["ttft_s_baseline"] for row in rows if "ttft_s_baseline" in row]
    ratios = [row["ttft_s_baseline"] / row["ttft_s"] for row in rows if "ttft_s_baseline" in row]
    return ServerReplayResult(
        server=url,
        baseline_server=baseline_url,
        requests=len(reqs),
        tokens_total=sum(len(r.tokens or ()) for r in reqs),
        ttft_s_median=statistics.median(cached) if cached else float("nan"),
        ttft_s_median_baseline=statistics.median(base) if base else float("nan"),
        ttft_ratio=statistics.median(ratios) if ratios else float("nan"),
        tokens_reused=after - before,
        per_request=rows,
    )
