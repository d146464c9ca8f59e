"""The compress-then-ask protocol shared by SEKV, the in-project baselines and the kvpress runner.

As kvpress evaluates presses: the context (with ``<bos>``) is prefilled and compressed *without* the
question; the question is fed afterwards and the answer decoded greedily. The ``niah_4q`` setting asks
four different single-key questions of one compressed context (built from a ``niah_multiquery``
example: four needles, each asked on its own), where a reversible memory should beat eviction. The
``ppl`` setting is held-out perplexity under compress-then-continue: a held-out ``text`` example is cut
into a context (prefilled and compressed) and a continuation of :data:`CONTINUATION` tokens that is fed
afterwards one token at a time and scored through the compressed cache.
Tasks are written to JSONL (:func:`write_jsonl`) so a runner in another environment sees the same
token ids; results come back the same way.

On a real pretrained model the ``real_*`` tasks (:data:`REAL_TASKS`) are the RULER needle shapes over licence
text through the model's chat template (:mod:`kvstate.lab.workloads.realtext`, the reference table's items): the
context is the chat prompt up to the end of the document, the "question" the rest of the prompt (the question and
the generation prompt), scored as ``string_match_all`` over the whole reply, as the reference table scores it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvstate.errors import KVStateError, TraceFormatError
from kvstate.io_safety import write_text_atomic
from kvstate.lab.workloads.tasks import DEPTH_TASKS, Example, generate

MULTI_Q = "niah_4q"
REAL_PREFIX = "real_"  # real_niah_single, ...: the real-text tasks on a model with a chat template
REAL_METRIC = "all_reply"  # string_match_all over the whole reply (not cut at its first full stop)
QUESTION_MARK = "Answer in one short sentence."  # where a real-text prompt's question part begins
PPL = "ppl"
CONTINUATION = 64  # tokens of held-out text fed after the compressed context (the first is fed, not scored)


@dataclass(frozen=True)
class Item:
    """One context with one or more questions, as token ids."""

    task: str
    length: int
    index: int
    depth: float | None
    context: list[int]  # <bos> + context tokens
    questions: list[list[int]]  # each: " question answer :" tokens (no special tokens)
    answers: list[list[str]]  # gold answers per question
    metric: str  # scoring metric of every question
    max_new_tokens: list[int]  # decode budget per question


def _ids(tokenizer: Any, text: str, special: bool) -> list[int]:
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def _item(tokenizer: Any, ex: Example, index: int) -> Item:
    ctx = _ids(tokenizer, ex.context, True)
    q = _ids(tokenizer, ex.question, False)
    if ctx + q != _ids(tokenizer, ex.prompt, True):
        raise KVStateError(f"task {ex.task!r}: the tokenizer does not split context and question at a token boundary")
    budget = len(_ids(tokenizer, ex.target, False)) + 8
    return Item(ex.task, ex.length, index, ex.depth, ctx, [q], [list(ex.answers)], ex.metric, [budget])


def _four_questions(tokenizer: Any, ex: Example, index: int) -> Item:
    words = ex.question.split()
    keys = [w for w in words[words.index("of") + 1: words.index("?")] if w != ","]
    if len(keys) != len(ex.answers):
        raise KVStateError(f"niah_multiquery question {ex.question!r} does not list one key per answer")
    ctx = _ids(tokenizer, ex.context, True)
    qs = [_ids(tokenizer, f"what is the secret code of {k} ? answer :", False) for k in keys]
    budgets = [len(_ids(tokenizer, a, False)) + 9 for a in ex.answers]
    return Item(MULTI_Q, ex.length, index, ex.depth, ctx, qs, [[a] for a in ex.answers], "exact", budgets)


def _continuation(tokenizer: Any, ex: Example, length: int, index: int) -> Item:
    ids = _ids(tokenizer, ex.prompt, True)
    if len(ids) < length + 2:
        raise KVStateError(f"ppl: the held-out text of {len(ids)} tokens is too short for a {length}-token context "
                           "plus a continuation; pass a shorter --length")
    cont = ids[length:length + CONTINUATION]
    return Item(PPL, length, index, None, ids[:length], [cont], [[]], "ppl", [0])


def real_tasks() -> tuple[str, ...]:
    """The real-text task names (``real_`` + each :data:`kvstate.lab.workloads.realtext.TASKS`)."""
    from kvstate.lab.workloads.realtext import TASKS as REAL

    return tuple(REAL_PREFIX + t for t in REAL)


def question_start(tokenizer: Any, ids: list[int]) -> int:
    """The first token of a real-text prompt's question part: the largest ``k`` whose suffix ``ids[k:]`` still
    decodes to text holding :data:`QUESTION_MARK` (a token that straddles the document's end goes with the
    question, so context + question is the prompt, token for token)."""
    for k in range(len(ids) - 1, -1, -1):
        if QUESTION_MARK in tokenizer.decode(ids[k:]):
            return k
    raise KVStateError(f"a real-text prompt holds no {QUESTION_MARK!r}; it was not built by "
                       "kvstate.lab.workloads.realtext")


def _real_item(tokenizer: Any, task: str, length: int, seed: int, index: int) -> Item:
    from kvstate.lab.models.realtext_eval import reply_budget
    from kvstate.lab.workloads import realtext as rt

    if getattr(tokenizer, "chat_template", None) is None:
        raise KVStateError(f"task {task!r} needs a model whose tokenizer has a chat template (a real pretrained "
                           "model, e.g. models/smollm2-135m-instruct); the synthetic tasks are the names without "
                           f"{REAL_PREFIX!r}")
    x = rt.make_item(tokenizer, task[len(REAL_PREFIX):], length, seed, index)
    ids = list(x.prompt_ids)
    k = question_start(tokenizer, ids)
    return Item(task, length, index, x.depth, ids[:k], [ids[k:]], [list(x.answers)], REAL_METRIC,
                [reply_budget(tokenizer, x, 48)])


def build_items(tokenizer: Any, task: str, length: int, n: int, seed: int) -> list[Item]:
    """``n`` held-out items of ``task`` (or :data:`MULTI_Q`, :data:`PPL`), needle depths spread evenly over [0, 1].

    :data:`PPL` items hold the context (``length`` tokens with ``<bos>``) and, as their one "question",
    the next :data:`CONTINUATION` tokens of the same held-out ``text`` example.
    """
    if task.startswith(REAL_PREFIX):
        return [_real_item(tokenizer, task, length, seed, i) for i in range(n)]
    if task == PPL:
        exs = generate("text", length + CONTINUATION, n, seed, tokenizer)
        return [_continuation(tokenizer, ex, length, i) for i, ex in enumerate(exs)]
    base = "niah_multiquery" if task == MULTI_Q else task
    depths = [i / (n - 1) if n > 1 else 0.5 for i in range(n)] if base in DEPTH_TASKS else None
    exs = generate(base, length, n, seed, tokenizer, depths=depths)
    make = _four_questions if task == MULTI_Q else _item
    return [make(tokenizer, ex, i) for i, ex in enumerate(exs)]


def write_jsonl(path: Path, rows: Iterable[dict[str, Any]]) -> None:
    """Write rows atomically (:func:`kvstate.io_safety.write_text_atomic`)."""
    write_text_atomic(path, "".join(json.dumps(row) + "\n" for row in rows))


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    out = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise TraceFormatError(f"{str(path)!r} line {i} is not JSON: {exc}") from exc
    return out


def items_to_rows(items: list[Item]) -> list[dict[str, Any]]:
    return [asdict(it) for it in items]


def rows_to_items(rows: list[dict[str, Any]]) -> list[Item]:
    try:
        return [Item(**r) for r in rows]
    except TypeError as exc:
        raise TraceFormatError(f"task row does not match the Item fields: {exc}") from exc
