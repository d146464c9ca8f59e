"""The lab's evaluation protocol: dev and test seeds, which tasks enter a quality score, cell sizes.

One implementation used by every axis's bench and by the report (``docs/lab.md``):

- **Dev and test items.** Seeds below ``TEST_SEED_MIN`` are for tuning; reported numbers come from
  test seeds (``TEST_SEEDS``). A method changed after its test numbers were seen is re-scored on a
  fresh test seed and both runs are kept (result files append runs, :mod:`kvstate.lab.provenance`).
- **Only tasks the full cache solves** (``>= SOLVED_AT`` at that length) enter a quality score; the
  others are shown, not averaged (:func:`solved_cells`).
- **Enough items**: ``HEADLINE_N`` items per headline cell (a rate near 0.5 then has a 95% interval
  of about ±0.1, :func:`kvstate.lab.stats.items_for_halfwidth`); ``PPL_TEXTS`` held-out texts for a
  perplexity.
- **Timings** are medians of ``TIMING_REPEATS`` interleaved repeats with their spread.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvstate.errors import KVStateError
from kvstate.lab import stats

DEV_SEEDS = (0, 1, 2, 3)  # tuning: anything may be tried on these
TEST_SEED_MIN = 1000  # seeds >= this are test seeds: reported numbers only
TEST_SEEDS = (1000, 1001, 1002, 1003)  # the next fresh test seed is the first not yet used in a result file
SOLVED_AT = 0.9  # a task enters a quality score where the full cache scores at least this
HEADLINE_N = 100  # items per headline cell
PPL_TEXTS = 200  # held-out texts per perplexity
TIMING_REPEATS = 5  # interleaved repeats per timing


def is_test_seed(seed: int) -> bool:
    return seed >= TEST_SEED_MIN


def check_reported_seed(seed: int, option: str = "--seed") -> None:
    """Refuse a dev seed for a run whose numbers are reported (a headline or a committed result)."""
    if not is_test_seed(seed):
        raise KVStateError(f"{option} {seed} is a dev seed (tuning only); reported numbers use a test seed "
                           f">= {TEST_SEED_MIN}, e.g. {option} {TEST_SEEDS[0]}")


def solved_cells(full_scores: Mapping[tuple[str, int], Sequence[float]]) -> list[tuple[str, int]]:
    """The (task, length) cells the full cache solves: mean score >= ``SOLVED_AT`` on the scored items."""
    return [cell for cell, scores in full_scores.items() if len(scores) and sum(scores) / len(scores) >= SOLVED_AT]


def combine_status(statuses: Sequence[stats.Status]) -> stats.Status:
    """All of several targets: ``missed`` if any is missed, ``met`` if all are met, else ``undecided``."""
    if not statuses:
        raise KVStateError("combine_status: no statuses to combine")
    if "missed" in statuses:
        return "missed"
    return "met" if all(s == "met" for s in statuses) else "undecided"


__all__ = ["DEV_SEEDS", "HEADLINE_N", "PPL_TEXTS", "SOLVED_AT", "TEST_SEEDS", "TEST_SEED_MIN", "TIMING_REPEATS",
           "check_reported_seed", "combine_status", "is_test_seed", "solved_cells"]
