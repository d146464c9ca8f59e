"""RULER-style scoring of generated answers.

Metrics follow RULER (Hsieh et al., 2024) and SQuAD (Rajpurkar et al., 2016):

- ``exact``: the normalised prediction equals a normalised answer (RULER's single-needle tasks).
- ``all``: the fraction of answers found in the prediction (RULER ``string_match_all``). Matching is on
  whole normalised words (``" 1 2 "`` inside ``" 4 1 2 "``) rather than raw substrings, so the answer
  ``cat`` is not found inside ``catalog``.
- ``f1``: SQuAD token F1, the maximum over answers.

Normalisation is SQuAD's: lower case, drop punctuation and the articles a / an / the, collapse spaces.
:func:`score` first cuts a prediction at its end marker (the first ``.``, ``<eos>`` or newline), because
the task format closes every answer with `` .`` and a model may keep generating after it.
Ignored: RULER's per-task weighting and aggregation across tasks (the harness averages).
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence
from typing import Protocol

_PUNCT = str.maketrans("", "", string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_END = re.compile(r"\.|<eos>|\n")


class Scorable(Protocol):
    """What :func:`score` reads from an example (:class:`kvstate.lab.workloads.tasks.Example`)."""

    task: str
    answers: Sequence[str]
    metric: str


def normalize(text: str) -> str:
    """SQuAD normalisation: lower case, no punctuation, no articles, single spaces."""
    return " ".join(_ARTICLES.sub(" ", text.lower().translate(_PUNCT)).split())


def extract_answer(prediction: str) -> str:
    """The prediction up to its end marker: the first ``.``, ``<eos>`` or newline (all of it if none)."""
    return _END.split(prediction, maxsplit=1)[0].strip()


def _check(answers: Sequence[str], fn: str) -> None:
    if isinstance(answers, str) or len(answers) == 0:
        raise ValueError(f"{fn}: answers={answers!r} must be a non-empty list of strings; "
                         "wrap a single answer as [answer]")


def exact_match(pred: str, answers: Sequence[str]) -> float:
    """1.0 if the normalised prediction equals any normalised answer, else 0.0."""
    _check(answers, "exact_match")
    p = normalize(pred)
    return float(any(p == normalize(a) for a in answers))


def string_match_all(pred: str, answers: Sequence[str]) -> float:
    """Fraction of ``answers`` that occur in ``pred`` as whole normalised words."""
    _check(answers, "string_match_all")
    p = f" {normalize(pred)} "
    return sum(f" {normalize(a)} " in p for a in answers) / len(answers)


def _f1(pred_tokens: list[str], gold_tokens: list[str]) -> float:
    if not pred_tokens or not gold_tokens:
        return float(pred_tokens == gold_tokens)  # SQuAD: both empty scores 1, one empty scores 0
    common = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred_tokens), common / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def f1(pred: str, answers: Sequence[str]) -> float:
    """SQuAD token-level F1 between prediction and answer, maximised over ``answers``."""
    _check(answers, "f1")
    p = normalize(pred).split()
    return max(_f1(p, normalize(a).split()) for a in answers)


METRIC_FUNCTIONS = {"exact": exact_match, "all": string_match_all, "f1": f1}


def score(example: Scorable, prediction: str) -> float:
    """Score a generated ``prediction`` (cut at its end marker) with the example's metric, in [0, 1]."""
    fn = METRIC_FUNCTIONS.get(example.metric)
    if fn is None:
        raise ValueError(f"score: example of task {example.task!r} has metric {example.metric!r}, which has no "
                         f"answer to score (valid: {', '.join(METRIC_FUNCTIONS)}); evaluate 'ppl' examples by "
                         "perplexity instead")
    return fn(extract_answer(prediction), example.answers)
