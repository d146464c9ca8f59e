"""kvstate.workloads — deterministic request streams and synthetic tasks (no downloads).

- :mod:`kvstate.workloads.traces`: overlap request streams shaped like seed 000's workloads, JSONL traces.
- :mod:`kvstate.workloads.language`, :mod:`~kvstate.workloads.tasks`, :mod:`~kvstate.workloads.tokenizer`:
  the synthetic language, RULER-shaped tasks and word-level tokenizer the reference models use.
"""

from kvstate.workloads.oracle import oracle_answer
from kvstate.workloads.tasks import (
    TASKS,
    Example,
    TaskConfig,
    generate,
    min_length,
    training_batch,
)
from kvstate.workloads.tokenizer import build_tokenizer, count_tokens
from kvstate.workloads.traces import WORKLOADS, Request, overlap_weights, read_trace, write_trace
from kvstate.workloads.traces import generate as generate_trace

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
