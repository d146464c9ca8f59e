"""Deterministic request streams shaped like the workloads of "Sparse Prefix Caching for Hybrid and Recurrent LLM Serving", and the JSONL trace format.

Real prefix overlaps are bimodal — none, or up to the document / system-prompt boundary — and that is
what makes distribution-aware checkpoint placement pay off. Generators (seeded, token ids drawn from
``vocab``):

- ``quality``: documents of 5–8K tokens, a few questions each, ~60% of requests overlap nothing;
- ``narrativeqa``: longer documents, many questions each (overlap near the full document);
- ``system_prompts``: a few prompts of 1–4K tokens, small edits at random positions, + user queries;
- ``chat``: append-only multi-turn conversations (the last state suffices: sparse checkpoints give no
  benefit, and should cost nothing).

Trace format (JSONL, one request per line), either
``{"tokens": [int, ...]}`` (replayable through a model), or
``{"prefix_id": "doc-3", "overlap": 5120, "length": 5400}`` (overlap depth against that prefix: enough
to plan checkpoints). Lines may carry both; blank lines and lines starting with ``#`` are skipped.
A length above :data:`MAX_TRACE_LENGTH` is refused when the trace is read: planning over it would
allocate per-depth arrays of that size.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvstate.errors import TraceFormatError
from kvstate.io_safety import read_text_input, write_text_atomic
from kvstate.prefix.histogram import OverlapHistogram
from kvstate.validate import check_float, check_int

WORKLOADS = ("quality", "narrativeqa", "system_prompts", "chat")
MAX_TRACE_LENGTH = 2**24  # 16.8M tokens: longer than any context; per-depth weights of it take 134 MB


@dataclass(frozen=True)
class Request:
    tokens: tuple[int, ...] | None  # the full prompt, or None for an overlap-only trace line
    prefix_id: str | None  # which shared prefix (document / system prompt / conversation) it reuses
    overlap: int  # tokens shared with that prefix as cached before this request
    length: int  # prompt length in tokens


def _rand(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    return [int(t) for t in rng.integers(0, vocab, size=n)]


def generate(workload: str, n_requests: int, seed: int = 0, vocab: int = 128, scale: float = 1.0) -> list[Request]:
    """A request stream; ``scale`` multiplies every length (e.g. 1/16 for tiny-model benchmarks)."""
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; choose one of {list(WORKLOADS)}.")
    check_int("n_requests", n_requests, 1, 10**7)
    check_int("seed", seed, 0)
    check_int("vocab", vocab, 2, 2**31 - 1)
    check_float("scale", scale, 0.0, 1.0, lo_open=True)
    rng = np.random.default_rng(seed)

    def sz(lo: int, hi: int) -> int:
        return max(2, int(rng.integers(lo, hi + 1) * scale))

    out: list[Request] = []
    if workload in ("quality", "narrativeqa"):
        d = 0
        while len(out) < n_requests:
            if workload == "quality":  # 1.67 questions per document on average: ~60% of requests overlap nothing
                doc, q = _rand(rng, sz(5000, 8000), vocab), int(rng.choice([1, 2, 3], p=[0.5, 0.33, 0.17]))
            else:
                doc, q = _rand(rng, sz(12000, 20000), vocab), int(rng.integers(6, 13))
            for k in range(q):
                question = _rand(rng, sz(20, 60), vocab)
                out.append(Request(tuple(doc + question), f"doc-{d}", len(doc) if k else 0, len(doc) + len(question)))
            d += 1
    elif workload == "system_prompts":
        prompts = [_rand(rng, sz(1000, 4000), vocab) for _ in range(4)]
        seen: set[int] = set()
        for _ in range(n_requests):
            i = int(rng.integers(len(prompts)))
            prompt = list(prompts[i])
            edit = len(prompt)
            if rng.random() < 0.3:  # a small edit: the overlap ends where the edit starts
                edit = int(rng.integers(1, len(prompt)))
                prompt[edit:edit + 8] = _rand(rng, min(8, len(prompt) - edit), vocab)
            query = _rand(rng, sz(30, 200), vocab)
            out.append(Request(tuple(prompt + query), f"sys-{i}", edit if i in seen else 0, len(prompt) + len(query)))
            seen.add(i)
    else:  # chat
        c = 0
        while len(out) < n_requests:
            convo: list[int] = []
            for _ in range(int(rng.integers(3, 8))):
                overlap = len(convo)
                convo = convo + _rand(rng, sz(100, 400), vocab)
                out.append(Request(tuple(convo), f"chat-{c}", overlap, len(convo)))
            c += 1
    return _true_overlaps(out[:n_requests])


def _true_overlaps(reqs: list[Request]) -> list[Request]:
    """Overlap = the longest common prefix with any earlier request of the same prefix_id."""
    seen: dict[str | None, list[np.ndarray]] = {}
    out = []
    for r in reqs:
        assert r.tokens is not None
        arr = np.asarray(r.tokens)
        best = 0
        for prev in seen.get(r.prefix_id, []):
            n = min(len(prev), len(arr))
            diff = np.flatnonzero(prev[:n] != arr[:n])
            best = max(best, int(diff[0]) if len(diff) else n)
        seen.setdefault(r.prefix_id, []).append(arr)
        out.append(Request(r.tokens, r.prefix_id, best, r.length))
    return out


def overlap_weights(requests: Iterable[Request], prefix_id: str | None = None, length: int | None = None) -> np.ndarray:
    """Histogram of overlap depths (weights for ``plan_checkpoints``), for one prefix or all: the library's
    :class:`~kvstate.prefix.histogram.OverlapHistogram` without decay or smoothing, over the whole trace."""
    depths = [r.overlap for r in requests if prefix_id is None or r.prefix_id == prefix_id]
    if not depths:
        raise TraceFormatError(f"no requests for prefix_id {prefix_id!r} in the trace.")
    if length is not None:
        check_int("length", length, 0, MAX_TRACE_LENGTH)
        if length < max(depths):
            raise ValueError(f"length: {length} is below the deepest overlap {max(depths)} in the trace; pass "
                             f"length >= {max(depths)} (or None for the deepest overlap)")
    hist = OverlapHistogram(length if length is not None else max(depths))
    hist.record_many(np.asarray(depths, dtype=np.int64))
    return hist.weights()


def write_trace(path: str | Path, requests: Iterable[Request]) -> None:
    """Write JSONL atomically (:func:`kvstate.io_safety.write_text_atomic`)."""
    rows = []
    for r in requests:
        row: dict[str, object] = {"length": r.length, "overlap": r.overlap}
        if r.prefix_id is not None:
            row["prefix_id"] = r.prefix_id
        if r.tokens is not None:
            row["tokens"] = list(r.tokens)
        rows.append(json.dumps(row) + "\n")
    write_text_atomic(path, "".join(rows))


def read_trace(path: str | Path) -> list[Request]:
    path = Path(path)
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "does not exist"
        raise TraceFormatError(f"trace file {str(path)!r} {what}; pass a JSONL file.")
    out = []
    for no, line in enumerate(read_text_input(path, "trace file").splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        out.append(_parse(line, path, no))
    if not out:
        raise TraceFormatError(f"trace file {str(path)!r} holds no requests.")
    return out


def _parse(line: str, path: Path, no: int) -> Request:
    where = f"{path}:{no}"
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceFormatError(f"{where}: not valid JSON ({exc.msg}); each line must be one JSON object.") from exc
    except RecursionError:
        raise TraceFormatError(f"{where}: JSON nested too deeply; each line must be one flat JSON object.") from None
    if not isinstance(row, dict):
        raise TraceFormatError(f"{where}: expected a JSON object, got {type(row).__name__}.")
    tokens = row.get("tokens")
    if tokens is not None and (not isinstance(tokens, list) or not all(isinstance(t, int) and t >= 0 for t in tokens)):
        raise TraceFormatError(f"{where}: 'tokens' must be a list of non-negative ints.")
    if tokens is None and "overlap" not in row:
        raise TraceFormatError(f"{where}: needs 'tokens' or ('prefix_id', 'overlap', 'length').")
    length = row.get("length", len(tokens) if tokens is not None else None)
    overlap = row.get("overlap", 0)
    for name, v in (("length", length), ("overlap", overlap)):
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= MAX_TRACE_LENGTH:
            raise TraceFormatError(f"{where}: {name!r} must be a non-negative int (at most {MAX_TRACE_LENGTH:,} tokens), got {v!r}.")
    assert isinstance(length, int) and isinstance(overlap, int)
    if overlap > length:
        raise TraceFormatError(f"{where}: overlap {overlap} exceeds length {length}.")
    if tokens is not None and len(tokens) != length:
        raise TraceFormatError(f"{where}: 'length' {length} != len(tokens) {len(tokens)}.")
    pid = row.get("prefix_id")
    if (pid is not None and not isinstance(pid, (str, int))) or isinstance(pid, bool):
        raise TraceFormatError(f"{where}: 'prefix_id' must be a string, got {pid!r}.")
    return Request(tuple(tokens) if tokens is not None else None, None if pid is None else str(pid), overlap, length)
