"""The lab's evaluation protocol: dev and test seeds, which tasks enter a quality score, cell sizes.

One implementation used by every axis's bench and by the report (``docs/lab.md``):

- **Dev and test items.** Seeds below ``TEST_SEED_MIN`` are for tuning; reported numbers come from
  test seeds (``>= TEST_SEED_MIN``). A method changed after its test numbers were seen is re-scored on a
  fresh test seed and both runs are kept (result files append runs, :mod:`kvstate.lab.provenance`).
  Enforced where a run is appended to a result file under ``models/``: :mod:`kvstate.lab.ledger` refuses
  a dev seed (:func:`check_reported_seed`) and a test seed already scored for that method by a different
  version of it.
- **Only tasks the reference solves** (full cache / oracle ``>= SOLVED_AT`` on that run) enter a quality
  score; the others are shown beside it, never averaged (:func:`solved_tasks`).
- **Enough items**: ``HEADLINE_N`` items per headline cell (a rate near 0.5 then has a 95% interval
  of about ±0.1, :func:`kvstate.lab.stats.items_for_halfwidth`); ``PPL_TEXTS`` held-out texts for a
  perplexity.
- **Timings** are medians of ``TIMING_REPEATS`` interleaved repeats with their spread.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from kvstate.errors import KVStateError
from kvstate.lab import stats

DEV_SEEDS = (0, 1, 2, 3)  # tuning: anything may be tried on these
TEST_SEED_MIN = 1000  # seeds >= this are test seeds: reported numbers only
TEST_SEEDS = (1000, 1001, 1002, 1003)  # the first test seeds; a fresh one is the first the ledger has not seen
SOLVED_AT = 0.9  # a task enters a quality score where the full cache scores at least this
HEADLINE_N = 100  # items per headline cell
PPL_TEXTS = 200  # held-out texts per perplexity
TIMING_REPEATS = stats.MIN_REPEATS  # interleaved repeats per timing (stats.timing refuses fewer)

K = TypeVar("K", bound=Hashable)


def is_test_seed(seed: int) -> bool:
    return seed >= TEST_SEED_MIN


def check_reported_seed(seed: int, option: str = "--seed", *, fresh: int | None = None) -> None:
    """Refuse a dev seed for a run whose numbers are reported (a headline or a committed result).

    ``fresh`` is the test seed the message suggests (default: the first test seed).
    """
    if not is_test_seed(seed):
        raise KVStateError(f"{option} {seed} is a dev seed (tuning only); reported numbers use a test seed "
                           f">= {TEST_SEED_MIN}: pick a fresh test seed, e.g. {option} {fresh or TEST_SEEDS[0]}")


@dataclass(frozen=True)
class Pooled(Generic[K]):
    """Which tasks (or (task, length) cells) enter a pooled quality score on one run."""

    solved: list[K]  # the reference scores >= SOLVED_AT on these: their items are pooled
    excluded: dict[K, float]  # the others, with the reference's mean score: shown beside, never averaged

    def pool(self, scores: Mapping[K, Sequence[float]]) -> list[float]:
        """One method's per-item scores over the solved tasks, concatenated in ``solved`` order."""
        missing = [k for k in self.solved if k not in scores]
        if missing:
            raise KVStateError(f"pool: no scores for solved task(s) {missing}; score the method on every task the "
                               "reference was scored on")
        return [float(x) for k in self.solved for x in scores[k]]


def solved_tasks(reference: Mapping[K, Sequence[float]]) -> Pooled[K]:
    """Split tasks by the reference's (full cache / oracle) per-item scores on this run.

    A task is solved when the reference's mean score is ``>= SOLVED_AT``; a task with no scored items is
    excluded (mean shown as 0). Only solved tasks are pooled into a quality score (:meth:`Pooled.pool`).
    """
    solved: list[K] = []
    excluded: dict[K, float] = {}
    for task, scores in reference.items():
        mean = sum(scores) / len(scores) if len(scores) else 0.0
        if len(scores) and mean >= SOLVED_AT:
            solved.append(task)
        else:
            excluded[task] = mean
    return Pooled(solved, excluded)


def solved_cells(full_scores: Mapping[tuple[str, int], Sequence[float]]) -> list[tuple[str, int]]:
    """The (task, length) cells the full cache solves: mean score >= ``SOLVED_AT`` (:func:`solved_tasks`)."""
    return solved_tasks(full_scores).solved


def combine_status(statuses: Sequence[stats.Status]) -> stats.Status:
    """All of several targets: ``missed`` if any is missed, ``met`` if all are met, else ``undecided``."""
    if not statuses:
        raise KVStateError("combine_status: no statuses to combine")
    if "missed" in statuses:
        return "missed"
    return "met" if all(s == "met" for s in statuses) else "undecided"


__all__ = ["DEV_SEEDS", "HEADLINE_N", "PPL_TEXTS", "SOLVED_AT", "TEST_SEEDS", "TEST_SEED_MIN", "TIMING_REPEATS",
           "Pooled", "check_reported_seed", "combine_status", "is_test_seed", "solved_cells", "solved_tasks"]
