"""The lab's one perplexity measurement: next-token NLL of a text's continuation, per text.

:func:`continuation_nll` scores ``ids[start + 1:]`` of one text either on top of a cache that holds
``ids[:start]`` (a full, compressed, shared or transferred cache: the tokens from ``ids[start]`` on are
fed through it with explicit positions) or from scratch (``cache=None``: one forward over the text
without a cache). ``ids[start]`` itself is never scored: a cache carries no logits for it. Each text
gives its summed NLL and token count (:class:`TextNLL`), so callers pool them
(:func:`pooled_perplexity`) or resample texts for an interval. Used by the harness's held-out
perplexity, the semantic benchmark's compress-then-continue rows and the transfer benchmark.

Ignored: batching, sliding windows over texts longer than the model's positions.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvstate.errors import KVStateError
from kvstate.lab.decode import as_ids, forward_at


@dataclass(frozen=True)
class TextNLL:
    """The scored continuation of one text."""

    nll: float  # summed next-token negative log-likelihood (nats) of the scored tokens
    tokens: int  # tokens scored
    seconds: float  # wall time of the forward calls that produced the scored logits


@torch.no_grad()
def continuation_nll(model: Any, ids: torch.Tensor | Sequence[int], start: int = 0, cache: Any = None, *,
                     stepwise: bool = False) -> TextNLL:
    """Summed NLL of ``ids[start + 1:]`` given ``ids[:start + 1]``.

    ``cache`` holds ``ids[:start]`` already (it is extended in place); ``None`` runs one forward over
    ``ids[:-1]`` with no cache instead. ``stepwise`` feeds the continuation one token per forward call
    (how a decoding server meets it; needs a cache) rather than in one call.
    """
    x = as_ids(ids)  # (1, T)
    t = x.shape[1]
    if not isinstance(start, int) or not 0 <= start <= t - 2:
        raise KVStateError(f"continuation_nll: start={start!r} must be an int in 0..{t - 2} so that at least one "
                           f"token of the {t}-token text is scored")
    if stepwise and cache is None:
        raise KVStateError("continuation_nll: stepwise=True needs a cache to feed one token at a time; pass one")
    t0 = time.perf_counter()
    if cache is None:
        pos = torch.arange(t - 1)[None]  # (1, T - 1)
        logits = model(input_ids=x[:, :-1], position_ids=pos, use_cache=False).logits[0, start:]  # (T - 1 - start, V)
    elif stepwise:
        logits = torch.cat([forward_at(model, cache, x[:, i:i + 1], i)[-1:] for i in range(start, t - 1)])
    else:
        logits = forward_at(model, cache, x[:, start:-1], start)  # (T - 1 - start, V)
    seconds = time.perf_counter() - t0
    target = x[0, start + 1:]  # (T - 1 - start,)
    nll = float(torch.nn.functional.cross_entropy(logits.float(), target, reduction="sum"))
    return TextNLL(nll, int(target.numel()), seconds)


def pooled_perplexity(rows: Iterable[TextNLL]) -> float:
    """``exp(total NLL / total tokens)`` over texts; NaN when nothing was scored."""
    nll, tokens = 0.0, 0
    for r in rows:
        nll, tokens = nll + r.nll, tokens + r.tokens
    return math.exp(nll / tokens) if tokens else float("nan")


__all__ = ["TextNLL", "continuation_nll", "pooled_perplexity"]
