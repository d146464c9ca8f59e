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

from collections.abc import Iterable, Mapping, Sequence
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


def message_ends_in(renderings: Iterable[Sequence[int] | None], prompt: Sequence[int], *, whole: bool,
                    below: int | None = None) -> list[int]:
    """The one rule for where messages end in a rendered prompt (the server's and :func:`chat_boundaries`).

    ``renderings[k - 1]`` is the token ids of the first ``k`` messages rendered alone (``None``: the template
    refused that prefix). The end of message ``k`` is how far that rendering agrees with ``prompt``: the whole
    rendering when ``whole`` (a rendering that is not a prefix of the prompt gives no position: a template
    that rewrites earlier messages yields fewer positions, never wrong ones), else its common prefix with the
    prompt (closing tokens that differ are not counted). Positions are kept strictly increasing, in
    ``1..below - 1`` (default: ``1..len(prompt)``).
    """
    limit = len(prompt) + 1 if below is None else below
    out: list[int] = []
    for ids in renderings:
        if ids is None:
            continue
        end = 0
        for a, b in zip(ids, prompt, strict=False):
            if a != b:
                break
            end += 1
        if whole and end != len(ids):
            continue
        if 0 < end < limit and end > (out[-1] if out else 0):
            out.append(end)
    return out


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
    renderings = (_render(tokenizer, messages[:k], f"the first {k} message(s)", **partial)
                  for k in range(1, len(messages) + 1))
    boundaries = message_ends_in(renderings, full, whole=False)
    return torch.tensor([full], dtype=torch.long), boundaries
