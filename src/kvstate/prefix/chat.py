"""Declared checkpoint boundaries from a chat template: where the requests of a conversation part.

Sparse prefix caching ("Sparse Prefix Caching for Hybrid and Recurrent LLM Serving") learns where
requests overlap; a chat server already knows: every later turn shares the conversation up to the end of
the system prompt and of each message. :func:`chat_boundaries` renders the conversation with the model's
own tokenizer and chat template and returns those positions, for ``SparsePrefixCache.prefill(ids,
boundaries=...)`` (``docs/techniques.md#position``). The end of message ``k`` is where the rendering of
the first ``k`` messages stops agreeing with the rendering of all of them (so a template's closing tokens
of a message count as part of it, and a generation prompt does not).

Ignores: tools and documents templates render outside the messages (pass them through
``template_kwargs``; their tokens then precede the first boundary).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kvstate.errors import KVStateError

_OURS = ("tokenize", "return_dict", "return_tensors")  # set here: the rendering must be a plain id list


def _render(tokenizer: Any, messages: Sequence[Mapping[str, Any]], what: str, **kwargs: Any) -> list[int]:
    try:
        ids = tokenizer.apply_chat_template(list(messages), tokenize=True, return_dict=False, **kwargs)
    except Exception as exc:  # a template that raises (no template, roles it refuses) names its own reason
        raise KVStateError(
            f"chat_boundaries: the tokenizer's chat template could not render {what} ({exc}); pass a tokenizer "
            "with a chat_template that accepts these messages."
        ) from exc
    if ids and isinstance(ids[0], list):  # a batch of one
        ids = ids[0]
    return [int(i) for i in ids]


def chat_boundaries(
    tokenizer: Any, messages: Sequence[Mapping[str, Any]], **template_kwargs: Any
) -> tuple[torch.Tensor, list[int]]:
    """``(input_ids (1, T), boundaries)`` for a conversation: the ids ``tokenizer.apply_chat_template``
    renders (with ``template_kwargs``, e.g. ``add_generation_prompt=True``) and the end of each message
    (the system prompt's first), strictly increasing in ``1..T``."""
    if not messages:
        raise KVStateError("chat_boundaries: messages is empty; pass at least one {'role', 'content'} message.")
    given = sorted(k for k in _OURS if k in template_kwargs)
    if given:
        raise KVStateError(
            f"chat_boundaries: {given} are set by chat_boundaries itself (it needs a plain id list); drop them."
        )
    full = _render(tokenizer, messages, "the conversation", **template_kwargs)
    partial = {k: v for k, v in template_kwargs.items() if k not in ("add_generation_prompt", "continue_final_message")}
    boundaries: list[int] = []
    for k in range(1, len(messages) + 1):
        ids = _render(tokenizer, messages[:k], f"the first {k} message(s)", **partial)
        end = 0
        for a, b in zip(ids, full, strict=False):
            if a != b:
                break
            end += 1
        if end > (boundaries[-1] if boundaries else 0):
            boundaries.append(end)
    return torch.tensor([full], dtype=torch.long), boundaries
