"""kvstate.eval — RULER-style scoring and the harness that runs a task set under a cache policy."""

from kvstate.eval.scoring import exact_match, extract_answer, f1, score, string_match_all

__all__ = ["exact_match", "extract_answer", "f1", "score", "string_match_all"]
