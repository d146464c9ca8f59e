"""kvstate.lab.workloads — deterministic request streams and synthetic tasks (no downloads).

- :mod:`kvstate.lab.workloads.traces`: overlap request streams shaped like the sparse prefix caching paper's workloads, JSONL traces.
- :mod:`kvstate.lab.workloads.language`, :mod:`~kvstate.lab.workloads.tasks`, :mod:`~kvstate.lab.workloads.tokenizer`:
  the synthetic language, RULER-shaped tasks and word-level tokenizer the reference models use.
"""

from importlib import import_module
from typing import Any

from kvstate.lab.workloads.traces import WORKLOADS, Request, overlap_weights, read_trace, write_trace
from kvstate.lab.workloads.traces import generate as generate_trace

# the task modules import transformers (tokenizers): loaded on first use, so the pure trace tools start fast
_LAZY = {
    "oracle_answer": "oracle",
    "TASKS": "tasks",
    "Example": "tasks",
    "TaskConfig": "tasks",
    "generate": "tasks",
    "min_length": "tasks",
    "training_batch": "tasks",
    "build_tokenizer": "tokenizer",
    "count_tokens": "tokenizer",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(f"kvstate.lab.workloads.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'kvstate.lab.workloads' has no attribute {name!r}")

__all__ = [
    "TASKS",
    "WORKLOADS",
    "Example",
    "Request",
    "TaskConfig",
    "build_tokenizer",
    "count_tokens",
    "generate",
    "generate_trace",
    "min_length",
    "oracle_answer",
    "overlap_weights",
    "read_trace",
    "training_batch",
    "write_trace",
]
