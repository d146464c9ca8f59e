"""The oracle reader of the synthetic tasks: recovers every answer from the prompt by rule.

Tests use it to prove each generated example is answerable from its context (it scores 1.0 on every
task), and the harness tests use it as a perfect "model". It knows the templates of
:mod:`kvstate.lab.workloads.tasks` and reads only the context and the question.
"""

from __future__ import annotations

from collections import Counter

from kvstate.lab.workloads.tasks import _INTRO, _QA, Example, _check_task, _find


def oracle_answer(example: Example) -> str:
    """Recover the answer from the prompt by rule, formatted like :attr:`Example.target` ('' for text).

    A reference reader: it knows the task templates and reads only context and question, so it scores
    1.0 on every generated example; a model that reads as well as this scores the same.
    """
    _check_task(example.task)
    ctx, q, task = example.context.split(), example.question.split(), example.task
    if task == "text":
        return ""
    if task.startswith("niah"):
        keys = [w for w in q[q.index("of") + 1:q.index("?")] if w != ","]
        answers = [" ".join(ctx[i:ctx.index(".", i)]) for key in keys
                   for i in _find(ctx, ["secret", "code", "of", key, "is"])]
    elif task == "vt":
        value = tuple(q[q.index("value") + 1:q.index("?")])
        bound: dict[str, tuple[str, ...]] = {}  # variable -> its value, in order of assignment
        for i in _find(ctx, ["="]):
            rhs = tuple(ctx[i:ctx.index(".", i)])
            bound[ctx[i - 2]] = bound[rhs[0]] if len(rhs) == 1 and rhs[0] in bound else rhs
        answers = [v for v, val in bound.items() if val == value]
    elif task in ("fwe", "cwe"):
        k = int("".join(q[q.index("the") + 1:q.index("most")]))
        answers = [w for w, _ in Counter(ctx[len(_INTRO[task]):-1]).most_common(k)]
    else:  # qa: match the question to its attribute template, then read that fact's value
        answers = []
        for pre, post, q_pre, q_post in _QA.values():
            name_at = len(q_pre)
            if q[:name_at] == q_pre and q[name_at + 1:name_at + 2 + len(q_post)] == [*q_post, "?"]:
                start = _find(ctx, [q[name_at], *pre])[0]
                answers = [" ".join(ctx[start:ctx.index(".", start) - len(post)])]
                break
    return " , ".join(answers) + " ."
