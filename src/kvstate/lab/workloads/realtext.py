"""RULER's needle tasks in natural English, asked through a real model's chat template.

The synthetic tasks (:mod:`kvstate.lab.workloads.tasks`) are for the models ``kvstate train`` makes; a pretrained
model with a real tokenizer gets these. The haystack is natural English prose a package installs: the licence
texts under ``/usr/share/common-licenses`` (Debian's ``base-files``, on every Debian machine; each text permits
verbatim copying), cut into sentences. The files in :data:`HELD_OUT` are never used as haystack: they are the
disjoint text of held-out perplexity (:func:`held_out_text`).

Tasks (the RULER shapes of "RULER: What's the Real Context Size of Your Long-Context Language Models?", Hsieh et
al. 2024, with its needle sentence "One of the special magic numbers for KEY is: VALUE."):

- ``niah_single``: one needle; asked for its number;
- ``niah_multikey``: four needles with different keys; asked for one key's number;
- ``niah_multivalue``: four needles for one key; asked for all its numbers;
- ``niah_multiquery``: four needles with different keys; asked for all four keys' numbers;
- ``vt``: variable tracking, a chain "VAR A = 52876", "VAR B = VAR A", ... hidden in the text; asked for every
  variable that holds the number.

An item is one user message (context, then the question) through the tokenizer's chat template with the
generation prompt; its length is the whole prompt's token count, filled with haystack sentences up to ``length``
(at most ``length``, within :data:`FIT_SLACK` below it: the haystack is cut at a word). A reply is scored as RULER's
``string_match_all`` (:mod:`kvstate.lab.scoring`, by the evaluator): the fraction of :attr:`Item.answers` found as
whole words in the greedy reply. Item ``i`` of ``(task, length,
seed)`` depends on nothing else. Ignored: RULER's essay haystack and its word / UUID keys (keys here are names,
values 7-digit numbers), the aggregation and QA tasks (``fwe``, ``cwe``, ``qa``).
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np

SOURCE_DIR = Path("/usr/share/common-licenses")
HAYSTACK = ("GPL-3", "GPL-2", "LGPL-2.1", "LGPL-3", "GFDL-1.3", "MPL-1.1", "Artistic")
HELD_OUT = ("Apache-2.0", "MPL-2.0", "GFDL-1.2")
SOURCE = ("Debian base-files: /usr/share/common-licenses (licence texts; verbatim copying permitted), "
          f"haystack {', '.join(HAYSTACK)}; held out {', '.join(HELD_OUT)}")
TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt")
FIT_SLACK = 64  # a prompt is within this many tokens below its length
KEYS = ("Alice", "Bruno", "Chen", "Dmitri", "Elena", "Farah", "Goran", "Hiro", "Ines", "Jonas", "Kofi", "Lena",
        "Mateo", "Nadia", "Oskar", "Priya", "Quentin", "Rosa", "Sven", "Tariq", "Uma", "Viktor", "Wen", "Yara")
VARS = ("QXV", "PLM", "ZKT", "RWN", "HBD", "JFS", "MGC", "TVY")


class RealTextError(ValueError):
    """A real-text task cannot be built (no source text, a length the prompt cannot fit)."""


@dataclass(frozen=True)
class Item:
    task: str
    length: int  # the requested prompt length in tokens
    index: int
    prompt_ids: tuple[int, ...]  # the whole chat prompt, generation prompt included
    answers: tuple[str, ...]  # every one must appear in the reply
    depth: float  # relative position of the (first) needle in the context


def _sentences(names: Sequence[str], source: Path) -> list[str]:
    out: list[str] = []
    for name in names:
        p = source / name
        if not p.is_file():
            raise RealTextError(f"{p} is missing: the real-text tasks read Debian's base-files licence texts; "
                                "install base-files (every Debian system has it) or pass another source directory")
        text = " ".join(p.read_text(encoding="utf-8", errors="replace").split())
        out += [s.strip() for s in re.split(r"(?<=[.;:!?])\s+(?=[A-Z0-9\"(])", text) if len(s.split()) >= 4]
    return out


@lru_cache(maxsize=4)
def haystack(source: Path = SOURCE_DIR) -> tuple[str, ...]:
    return tuple(_sentences(HAYSTACK, source))


def held_out_text(source: Path = SOURCE_DIR) -> str:
    """Disjoint text of the same source (never a haystack), for held-out perplexity."""
    return " ".join(_sentences(HELD_OUT, source))


def _rng(task: str, length: int, seed: int, index: int) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(task.encode()), length, index])


def _number(rng: np.random.Generator) -> str:
    return str(int(rng.integers(1_000_000, 10_000_000)))


def _needles(task: str, rng: np.random.Generator) -> tuple[list[str], str, tuple[str, ...]]:
    """(needle sentences in order of appearance, question, expected answers)."""
    keys = [str(k) for k in rng.choice(KEYS, size=4, replace=False)]
    nums = [_number(rng) for _ in range(4)]
    say = "One of the special magic numbers for {} is: {}."
    if task == "niah_single":
        return [say.format(keys[0], nums[0])], f"What is the special magic number for {keys[0]}?", (nums[0],)
    if task == "niah_multikey":
        ask = int(rng.integers(0, 4))
        return ([say.format(k, n) for k, n in zip(keys, nums, strict=True)],
                f"What is the special magic number for {keys[ask]}?", (nums[ask],))
    if task == "niah_multivalue":
        return ([say.format(keys[0], n) for n in nums],
                f"What are all the special magic numbers for {keys[0]}?", tuple(nums))
    if task == "niah_multiquery":
        return ([say.format(k, n) for k, n in zip(keys, nums, strict=True)],
                f"What are the special magic numbers for {', '.join(keys[:3])} and {keys[3]}?", tuple(nums))
    if task == "vt":
        names = [str(v) for v in rng.choice(VARS, size=4, replace=False)]
        chain = [f"VAR {names[0]} = {nums[0]}."] + [f"VAR {b} = VAR {a}." for a, b in pairwise(names)]
        return (chain, f"Which variables are assigned the value {nums[0]}? List all of them.", tuple(names))
    raise RealTextError(f"task {task!r} is not a real-text task; choose one of {', '.join(TASKS)}")


def _prompt(tokenizer: Any, context: str, question: str) -> list[int]:
    msg = (f"Read the text below and remember the special facts hidden in it.\n\n{context}\n\n"
           f"Answer in one short sentence. {question}")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": msg}], add_generation_prompt=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    return [int(i) for i in ids]


def _context(sentences: Sequence[str], start: int, words: int, needles: Sequence[str], depths: np.ndarray) -> str:
    """``words`` haystack words from sentence ``start`` on (the last sentence cut at a word), needles between
    sentences at ``depths`` of the way through."""
    hay: list[str] = []
    left, j = words, start
    while left > 0:
        w = sentences[j % len(sentences)].split()
        hay.append(" ".join(w[:left]))
        left -= len(w)
        j += 1
    parts = list(hay)
    for k, (d, needle) in enumerate(zip(depths, needles, strict=True)):
        parts.insert(int(d * len(hay)) + k, needle)
    return " ".join(parts)


def make_item(tokenizer: Any, task: str, length: int, seed: int, index: int, source: Path = SOURCE_DIR) -> Item:
    """Item ``index`` of ``(task, length, seed)``: haystack from a seeded sentence on, needles at seeded depths
    between sentences, the most haystack words whose chat prompt fits ``length`` (found by bisection)."""
    rng = _rng(task, length, seed, index)
    needles, question, answers = _needles(task, rng)
    sentences = haystack(source)
    base = len(_prompt(tokenizer, " ".join(needles), question))
    if base + FIT_SLACK > length:
        raise RealTextError(f"length {length} is too short for {task}: its needles and question take {base} tokens")
    start = int(rng.integers(0, len(sentences)))
    depths = np.sort(rng.uniform(0.05, 0.95, size=len(needles)))

    def ids_for(words: int) -> list[int]:
        return _prompt(tokenizer, _context(sentences, start, words, needles, depths), question)

    lo, hi = 1, max(2, 2 * (length - base))  # a word is at least one token: hi words never fit
    best = ids_for(lo)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        ids = ids_for(mid)
        if len(ids) <= length:
            lo, best = mid, ids
        else:
            hi = mid - 1
    if not length - FIT_SLACK <= len(best) <= length:
        raise RealTextError(f"could not fit {task} item {index} into {length} tokens (got {len(best)})")
    return Item(task, length, index, tuple(best), answers, float(depths[0]))


def items(tokenizer: Any, task: str, length: int, n: int, seed: int, source: Path = SOURCE_DIR) -> list[Item]:
    return [make_item(tokenizer, task, length, seed, i, source) for i in range(n)]


__all__ = ["FIT_SLACK", "HAYSTACK", "HELD_OUT", "SOURCE", "TASKS", "Item", "RealTextError", "haystack",
           "held_out_text", "items", "make_item"]
