"""Retrieval drills: training rows that ask for *every* needle of a needle document, one after another.

A training-only companion of :mod:`kvstate.lab.workloads.tasks` for the reference models (``models/README.md``). A RULER
``niah_multikey`` row teaches key selection with one answer per ~1K tokens of prose; at 1K tokens and a
4K-token batch that is three or four retrievals per optimizer step, and the 4-layer attention model sat
at chance on multi-key selection for 100 minutes (``models/ref-attn/README.md``). A drill row holds a document with ``k``
needles (``the secret code of <name> is <digits> .``, same generator and filler as ``niah_multikey``)
followed by ``k`` question/answer pairs in a random order::

    <bos> document  what is the secret code of B ? answer : 3 1 4 1 5 9 .  what is ... A ? answer : ... . <eos>

so every row carries ``k`` key-selection and ``k x code_digits`` copy targets.

:func:`copy_batch` is the second drill, for the attention-only model: it located the right needle but
garbled the code after three digits (``9 4 6 5 2 5`` -> ``9 4 6 5 5 5``), the signature of a missing
induction (previous-token + match) circuit, which a short causal conv gives the hybrid for free. Rows of
``the list is w1 .. wn . read the list again : w1 .. wn .`` with random digits and names (n in [4, 24]) make
every token of the repeat predictable only by copying from the matching place, the data on which
induction heads are known to form quickly (Olsson et al., 2022, "In-context learning and induction heads"). The questions are the eval
question verbatim; each answer is produced with the earlier pairs in view, which never reveals it (names
are distinct). The prose comes from a third seed stream (:data:`DRILL_STREAM`), disjoint from both the
held-out examples of :func:`~kvstate.lab.workloads.tasks.generate` and the rows of
:func:`~kvstate.lab.workloads.tasks.training_batch`. Not an evaluation task (there is no single answer).
"""

from __future__ import annotations

import numpy as np
from transformers import PreTrainedTokenizerBase

from kvstate.lab.workloads import language as lang
from kvstate.lab.workloads.tasks import CUE, TaskConfig, _find, _make

DRILL_STREAM = 2  # tasks.EVAL_STREAM = 0, tasks.TRAIN_STREAM = 1
QUESTION = ["what", "is", "the", "secret", "code", "of"]  # + name + "?" + CUE, as niah_multikey asks


def drill_keys(length: int, code_digits: int = 6, max_keys: int = 8) -> int:
    """Most needles a drill row of ``length`` tokens holds: each costs ~a needle plus a question and answer."""
    per_key = 2 * (len(QUESTION) + 2 + code_digits) + len(CUE) + 2  # needle + question + answer, rounded up
    return max(1, min(max_keys, (length - 24) // per_key))


def _pairs(context: list[str]) -> list[tuple[str, list[str]]]:
    """(name, code words) of each needle in ``context``, in reading order."""
    out = []
    for i in _find(context, ["secret", "code", "of"]):
        name, code_at = context[i], i + 2  # "<name> is <digits> ."
        out.append((name, context[code_at:context.index(".", code_at)]))
    return out


def drill_batch(length: int, batch: int, seed: int, tokenizer: PreTrainedTokenizerBase, *,
                answer_weight: float = 10.0, max_keys: int = 8,
                config: TaskConfig | None = None) -> tuple[np.ndarray, np.ndarray]:
    """A ``(batch, length)`` batch of drill rows, laid out like :func:`~kvstate.lab.workloads.tasks.training_batch`.

    Row ``r`` draws ``k`` in ``[1, drill_keys(length)]`` needles (``k = 1`` is a single-needle row) and asks
    for all of them. Weights: 0 for ``<bos>`` and padding, 1 for document and question tokens,
    ``answer_weight`` for every answer token (codes, their ``.``, and the final ``<eos>``). Deterministic
    in ``(length, batch, seed)``.
    """
    for name, value, lo in (("length", length, 48), ("batch", batch, 1), ("seed", seed, 0)):
        if not isinstance(value, int) or value < lo:
            raise ValueError(f"drill_batch: {name}={value!r} must be an int >= {lo}")
    if not answer_weight > 0:
        raise ValueError(f"drill_batch: answer_weight={answer_weight} must be > 0")
    cfg = config or TaskConfig()
    top = drill_keys(length, cfg.code_digits, max_keys)
    input_ids = np.full((batch, length), tokenizer.pad_token_id, dtype=np.int64)
    weights = np.zeros((batch, length), dtype=np.float32)
    for row in range(batch):
        rng = np.random.default_rng([seed, DRILL_STREAM, row])
        k = int(rng.integers(1, top + 1))
        task = "niah_single" if k == 1 else "niah_multikey"
        task_cfg = TaskConfig(n_keys=max(k, 2), code_digits=cfg.code_digits)
        tail = k * (len(QUESTION) + 2 + len(CUE) + cfg.code_digits + 1)  # the k question/answer pairs
        budget = length - 2 - tail
        while True:  # shrink the document until <bos> + document + pairs + <eos> fits the row
            ex = _make(task, budget, DRILL_STREAM, seed, row, tokenizer, task_cfg, None)
            context = ex.context.split()
            pairs = _pairs(context)
            order = rng.permutation(len(pairs)) if len(pairs) > 1 else [0]
            segments: list[tuple[str, bool]] = [(ex.context, False)]
            for i in order:
                name, code = pairs[int(i)]
                segments += [(" ".join([*QUESTION, name, "?", *CUE]), False), (" ".join([*code, "."]), True)]
            ids, marks = [tokenizer.bos_token_id], [0.0]
            for text, is_answer in segments:
                piece = tokenizer(text, add_special_tokens=False)["input_ids"]
                ids += piece
                marks += [answer_weight if is_answer else 1.0] * len(piece)
            ids.append(tokenizer.eos_token_id)
            marks.append(answer_weight)
            overflow = len(ids) - length
            if overflow <= 0:
                break
            budget -= overflow
        input_ids[row, :len(ids)] = ids
        weights[row, :len(ids)] = marks
    return input_ids, weights


COPY_OPEN, COPY_REPEAT = ["the", "list", "is"], ["read", "the", "list", "again", ":"]


def copy_batch(length: int, batch: int, seed: int, tokenizer: PreTrainedTokenizerBase, *,
               answer_weight: float = 10.0, min_items: int = 4, max_items: int = 24) -> tuple[np.ndarray, np.ndarray]:
    """A ``(batch, length)`` batch of copy drills: ``<bos>`` then list/repeat pairs until the row is full.

    Each list draws ``n`` in ``[min_items, max_items]`` tokens, digits only (half the lists: the repeat
    needs more than the previous token to find its place) or digits and names. Weights: 1 for the lists and
    cues, ``answer_weight`` for the repeated tokens and their ``.``; padding after the last whole pair is 0.
    """
    for name, value, lo in (("length", length, 2 * min_items + 16), ("batch", batch, 1), ("seed", seed, 0)):
        if not isinstance(value, int) or value < lo:
            raise ValueError(f"copy_batch: {name}={value!r} must be an int >= {lo}")
    if not 1 <= min_items <= max_items:
        raise ValueError(f"copy_batch: need 1 <= min_items ({min_items}) <= max_items ({max_items})")
    digits = [str(d) for d in range(10)]
    mixed = digits + list(lang.NAMES)
    input_ids = np.full((batch, length), tokenizer.pad_token_id, dtype=np.int64)
    weights = np.zeros((batch, length), dtype=np.float32)
    for row in range(batch):
        rng = np.random.default_rng([seed, DRILL_STREAM, row, 1])
        ids, marks = [tokenizer.bos_token_id], [0.0]
        while True:
            n = int(rng.integers(min_items, max_items + 1))
            pool = digits if rng.random() < 0.5 else mixed
            items = [pool[int(i)] for i in rng.integers(len(pool), size=n)]
            prompt = tokenizer(" ".join([*COPY_OPEN, *items, ".", *COPY_REPEAT]), add_special_tokens=False)["input_ids"]
            answer = tokenizer(" ".join([*items, "."]), add_special_tokens=False)["input_ids"]
            if len(ids) + len(prompt) + len(answer) > length:
                break
            ids += prompt + answer
            marks += [1.0] * len(prompt) + [answer_weight] * len(answer)
        if len(ids) == 1:
            raise ValueError(f"copy_batch: length={length} cannot hold a list of {max_items} items; pass a longer "
                             "length or a smaller max_items")
        input_ids[row, :len(ids)] = ids
        weights[row, :len(ids)] = marks
    return input_ids, weights


__all__ = ["COPY_OPEN", "COPY_REPEAT", "DRILL_STREAM", "copy_batch", "drill_batch", "drill_keys"]
