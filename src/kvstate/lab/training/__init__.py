"""kvstate.lab.training — RULER-style scoring, the harness that runs a task set under a cache policy, and training
of the small reference models."""

from kvstate.lab.harness import EvalResult, TaskScore, load_reference, perplexity, run_tasks
from kvstate.lab.scoring import exact_match, extract_answer, f1, score, string_match_all

__all__ = [
    "EvalResult",
    "TaskScore",
    "exact_match",
    "extract_answer",
    "f1",
    "load_reference",
    "perplexity",
    "run_tasks",
    "score",
    "string_match_all",
]
