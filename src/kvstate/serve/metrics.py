"""``/metrics``: the server's and the prefix cache's counters in the Prometheus text format.

A ``prometheus_client`` collector on a registry of its own (several servers in one process do not
share counters) reads everything at scrape time: the store's :class:`StoreMetrics` snapshot (requests,
hits, prompt tokens reused / recomputed / lost to a missing checkpoint, bytes held by kind, evictions,
rejected inserts), the store nodes left pinned after the last request, the shared tier's counters and
``up`` gauge (with ``--remote``), the queue's depth and the server's own request outcomes and token counts.

Beside the project's own names, vLLM's prefix-cache counters, so clients that scrape a vLLM server (GuideLLM,
inference-perf, ``vllm bench serve``-style tools) read the hit rate here too: ``vllm:prefix_cache_queries``
(prompt tokens looked up in the prefix cache) and ``vllm:prefix_cache_hits`` (prompt tokens restored from it),
counters in tokens labelled ``model_name`` and ``engine`` as vLLM's are (names and meaning from vLLM's
Prometheus logger, Apache-2.0; no code taken). Counted per finished request, the same numbers as its
``usage.prompt_tokens_details.cached_tokens``; without a prefix cache nothing is looked up and both stay 0.

Memory: the bytes the running decode batch holds for its requests (:class:`~kvstate.serve.batching.BatchBytes`,
measured from its tensors, by kind: the rows' own KV, its left padding, the recurrent states; a request being
prefilled is not counted until it joins), their peak, and the process's resident set size —
``prometheus_client``'s process collector (``process_resident_memory_bytes`` and the rest, from ``/proc``,
Linux only) and the peak RSS from ``getrusage``.
"""

from __future__ import annotations

import resource
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvstate.serve.generation import Generation, Generator
from kvstate.serve.scheduler import Scheduler

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
VLLM_ENGINE = "0"  # vLLM's ``engine`` label: the engine index; this server runs one


class ServerCounters:
    """Request outcomes and token totals, counted by the server whether or not a prefix cache is on."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.outcomes: Counter[str] = Counter()
        self.tokens: Counter[str] = Counter()

    def outcome(self, name: str) -> None:
        with self._lock:
            self.outcomes[name] += 1

    def generation(self, g: Generation) -> None:
        with self._lock:
            self.tokens["prompt"] += g.prompt_tokens
            self.tokens["completion"] += g.completion_tokens
            self.tokens["reused"] += g.reused_tokens
            self.tokens["recomputed"] += g.recomputed_tokens

    def snapshot(self) -> tuple[dict[str, int], dict[str, int]]:
        with self._lock:
            return dict(self.outcomes), dict(self.tokens)


class _Collector:
    def __init__(self, generator: Generator, scheduler: Scheduler, counters: ServerCounters, model_name: str) -> None:
        self.generator, self.scheduler, self.counters, self.model_name = generator, scheduler, counters, model_name

    def collect(self) -> Iterator[Metric]:
        outcomes, tokens = self.counters.snapshot()
        c = CounterMetricFamily("kvstate_requests", "HTTP generation requests by outcome", labels=["outcome"])
        for name in ("ok", "cancelled", "queue_full", "invalid", "error", "shutdown"):
            c.add_metric([name], outcomes.get(name, 0))
        yield c
        t = CounterMetricFamily("kvstate_tokens", "Tokens served, by kind (prompt tokens reused from "
                                "the prefix cache or recomputed)", labels=["kind"])
        for name in ("prompt", "completion", "reused", "recomputed"):
            t.add_metric([name], tokens.get(name, 0))
        yield t
        yield GaugeMetricFamily("kvstate_queue_depth", "Requests waiting for the model", value=self.scheduler.depth)
        yield GaugeMetricFamily("kvstate_queue_capacity", "Requests that may wait (--max-queue)",
                                value=self.scheduler.max_queue)
        yield GaugeMetricFamily("kvstate_running_requests", "Requests being generated now",
                                value=self.scheduler.running)
        yield from self._memory()
        cache = self.generator.cache
        yield from self._vllm(tokens, looked_up=cache is not None)
        yield GaugeMetricFamily("kvstate_prefix_cache_enabled", "1 when a prefix cache serves requests",
                                value=int(cache is not None))
        if cache is not None:
            yield from _cache_metrics(cache, self.generator.pinned_nodes)

    def _vllm(self, tokens: dict[str, int], looked_up: bool) -> Iterator[Metric]:
        labels, values = ["model_name", "engine"], [self.model_name, VLLM_ENGINE]
        q = CounterMetricFamily("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache (vLLM's "
                                "name; 0 without a prefix cache)", labels=labels)
        q.add_metric(values, tokens.get("prompt", 0) if looked_up else 0)
        yield q
        h = CounterMetricFamily("vllm:prefix_cache_hits", "Prompt tokens restored from the prefix cache instead of "
                                "computed (vLLM's name)", labels=labels)
        h.add_metric(values, tokens.get("reused", 0))
        yield h

    def _memory(self) -> Iterator[Metric]:
        held = self.scheduler.batch_bytes
        b = GaugeMetricFamily("kvstate_batch_bytes", "Bytes the running decode batch holds for its requests, "
                              "measured from its tensors, by kind (kv: their tokens' attention KV, padding: its "
                              "left padding, recurrent: conv and recurrent states)", labels=["kind"])
        for kind, value in (("kv", held.kv), ("padding", held.padding), ("recurrent", held.recurrent)):
            b.add_metric([kind], value)
        yield b
        yield GaugeMetricFamily("kvstate_batch_requests", "Requests in the running decode batch (whose bytes "
                                "kvstate_batch_bytes counts)", value=held.rows)
        yield GaugeMetricFamily("kvstate_batch_peak_bytes", "Most bytes the decode batch held at once",
                                value=self.scheduler.batch_peak_bytes)
        yield GaugeMetricFamily("kvstate_process_peak_resident_memory_bytes", "Peak resident set size of the "
                                "server's process (getrusage)", value=peak_rss_bytes())


def peak_rss_bytes() -> int:
    """The process's peak resident set size in bytes (``ru_maxrss`` is in KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def _cache_metrics(cache: Any, pinned_nodes: int) -> Iterator[Metric]:
    m = cache.metrics
    for name, value, doc in (
        ("requests", m.requests, "Prefills served by the prefix cache"),
        ("hits", m.hits, "Prefills that resumed from a stored state"),
        ("prompt_tokens", m.tokens_total, "Prompt tokens of every prefill"),
        ("reused_tokens", m.tokens_reused, "Prompt tokens restored instead of computed"),
        ("recomputed_tokens", m.tokens_recomputed, "Prompt tokens run through the model"),
        ("lost_tokens", m.tokens_lost_to_missing_checkpoint, "Tokens stored but recomputed for want of a checkpoint"),
        ("evicted_nodes", m.evicted_nodes, "Radix-tree nodes evicted under the budget"),
        ("evicted_states", m.evicted_states, "Recurrent states evicted under the budget"),
        ("rejected_inserts", m.rejected_inserts, "Inserts that did not fit the budget"),
    ):
        yield CounterMetricFamily(f"kvstate_prefix_{name}", doc, value=value)
    b = GaugeMetricFamily("kvstate_prefix_bytes", "Bytes the prefix cache holds, by kind", labels=["kind"])
    for kind, value in cache.bytes_by_kind().items():
        b.add_metric([kind], value)
    yield b
    yield GaugeMetricFamily("kvstate_prefix_peak_bytes", "Most bytes held at once", value=m.peak_bytes)
    yield GaugeMetricFamily("kvstate_prefix_budget_bytes", "The prefix cache's byte budget",
                            value=cache.config.budget_bytes)
    yield GaugeMetricFamily("kvstate_prefix_pinned_nodes", "Store nodes pinned after the last request",
                            value=pinned_nodes)
    r = cache.remote_metrics
    yield GaugeMetricFamily("kvstate_prefix_remote_enabled", "1 when a shared tier (--remote) backs the cache",
                            value=int(r is not None))
    if r is None:
        return
    for name, value, doc in (
        ("hits", r.hits, "Local misses resumed from the shared tier"),
        ("misses", r.misses, "Local misses the shared tier could not improve on"),
        ("bad_entries", r.corrupt, "Shared-tier entries refused (bad checksum, another model, wrong shapes)"),
        ("errors", r.errors, "Shared-tier calls that failed (refused, timed out)"),
        ("puts", r.puts, "Entries written through to the shared tier"),
        ("reused_tokens", r.tokens_reused, "Prompt tokens restored from the shared tier beyond the local hit"),
    ):
        yield CounterMetricFamily(f"kvstate_prefix_remote_{name}", doc, value=value)
    yield GaugeMetricFamily("kvstate_prefix_remote_up", "1 while the shared tier answers (0: serving local-only)",
                            value=int(r.up))


def registry(generator: Generator, scheduler: Scheduler, counters: ServerCounters, model_name: str
             ) -> CollectorRegistry:
    """A registry of this server's own: its collector and ``prometheus_client``'s process collector."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(_Collector(generator, scheduler, counters, model_name))
    ProcessCollector(registry=reg)
    return reg


def render(reg: CollectorRegistry) -> bytes:
    return generate_latest(reg)
