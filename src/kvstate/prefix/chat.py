"""Declared checkpoint boundaries from a chat template: where the requests of a conversation part.

Sparse prefix caching ("Sparse Prefix Caching for Hybrid and Recurrent LLM Serving") learns where
requests overlap; a chat server already knows: every later turn shares the conversation up to the end of
the system prompt and of each message. :func:`chat_boundaries` renders the conversation with the model's
own tokenizer and chat template and returns those positions, for ``SparsePrefixCache.prefill(ids,
boundaries=...)`` (``docs/techniques.md#position``). The end of message ``k`` is where the rendering of
the first ``k`` messages stops agreeing with the rendering of all of them (so a template's closing tokens
of a message count as part of it, and a generation prompt does not).

Found in time linear in the conversation (:func:`find_message_ends`): the conversation is rendered once more
with a mark after each message's content, which gives where each content ends in the rendered text; the
text the template closes a message of each role with (learned once per role from a one-message rendering)
must follow; the token position is read from the one tokenization's offsets and checked by tokenizing that
message's span alone. A message for which any of this fails is found the old way, by rendering the first
``k`` messages (a template that does not pass contents through verbatim: every message).

Ignores: tools and documents templates render outside the messages (pass them through
``template_kwargs``; their tokens then precede the first boundary).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Mapping, MutableMapping, Sequence
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
    return _kept((None if ids is None else _agreement(ids, prompt, whole) for ids in renderings), prompt, below)


def _agreement(ids: Sequence[int], prompt: Sequence[int], whole: bool) -> int | None:
    """How far ``ids`` agrees with ``prompt`` (None when ``whole`` and it is not a prefix of it)."""
    end = 0
    for a, b in zip(ids, prompt, strict=False):
        if a != b:
            break
        end += 1
    return None if whole and end != len(ids) else end


def _kept(ends: Iterable[int | None], prompt: Sequence[int], below: int | None) -> list[int]:
    limit = len(prompt) + 1 if below is None else below
    out: list[int] = []
    for end in ends:
        if end is not None and 0 < end < limit and end > (out[-1] if out else 0):
            out.append(end)
    return out


_MARK = "\ue000{}\ue001"  # private-use characters: what a mark is made of never occurs in a checked message
_PROBE = "\ue000probe\ue001"

Render = Callable[[Sequence[Mapping[str, Any]]], "str | None"]  # a message list's text (None: refused)


def _tail(render: Render, role: str) -> str | None:
    """The text the template puts after a ``role`` message's content when that message is the last one
    rendered (its closing text, and what ends a conversation): from one probe rendering, once per role."""
    for before in ([], [{"role": "user", "content": "probe"}]):  # some templates refuse a lone assistant message
        try:
            text = render([*before, {"role": role, "content": _PROBE}])
        except Exception:  # a refusal the caller's render raises: this probe tells nothing
            text = None
        if text is not None and text.count(_PROBE) == 1:
            return text[text.index(_PROBE) + len(_PROBE):]
    return None


def _content_ends(render: Render, messages: Sequence[Mapping[str, Any]], text: str) -> list[int] | None:
    """Where each message's content ends in ``text`` (the conversation's rendering, with or without a
    generation prompt), from one rendering with a mark after each content; None when the template does not
    pass contents through verbatim."""
    if any(not isinstance(m.get("content"), str) or "\ue000" in m["content"] or "\ue001" in m["content"]
           for m in messages):
        return None
    marks = [_MARK.format(k) for k in range(len(messages))]
    marked = render([{**m, "content": m["content"] + mark} for m, mark in zip(messages, marks, strict=True)])
    if marked is None:
        return None
    ends, parts, at = [], [], 0
    for mark in marks:
        i = marked.find(mark, at)
        if i < 0:
            return None
        parts.append(marked[at:i])
        at = i + len(mark)
        ends.append(sum(map(len, parts)))  # parts' lengths so far: the position in the unmarked text
    parts.append(marked[at:])
    # the marked rendering minus its marks must be the conversation's own up to the last content
    n = ends[-1] if ends else 0
    return ends if "".join(parts)[:n] == text[:n] else None


def find_message_ends(
    messages: Sequence[Mapping[str, Any]],
    text: str,
    prompt: Sequence[int],
    spans: Sequence[tuple[int, int]] | None,
    render: Render,
    tokenize: Callable[[str], list[int]],
    tails: MutableMapping[str, str | None],
    *,
    whole: bool,
    below: int | None = None,
) -> list[int]:
    """:func:`message_ends_in` over the renderings of the first ``k`` messages, in time linear in the messages.

    ``text`` is the conversation's rendering and ``prompt`` its tokens, token ``i`` covering
    ``text[spans[i][0]:spans[i][1]]`` (None: no offsets, every message is found the old way); ``render`` renders
    a message list without a generation prompt (None: the template refuses it); ``tokenize`` tokenizes text
    as ``prompt`` was (no special tokens added); ``tails`` memoizes each role's closing text (keep one per
    tokenizer and template)."""

    def old(k: int) -> int | None:  # the rule itself: render the first k messages
        part = render(messages[:k])
        return None if part is None else _agreement(tokenize(part), prompt, whole)

    content = None if spans is None else _content_ends(render, messages, text)
    if content is None or spans is None:
        return _kept((old(k) for k in range(1, len(messages) + 1)), prompt, below)
    starts = [a for a, _ in spans]
    ends: list[int | None] = []
    at_char, at_token = 0, 0
    for k, (m, c) in enumerate(zip(messages, content, strict=True), start=1):
        role = str(m.get("role"))
        if role not in tails:
            tails[role] = _tail(render, role)
        tail = tails[role]
        if tail is None:  # the template cannot be probed for this role
            ends.append(old(k))
            continue
        if not text.startswith(tail, c):  # the rendering of the first k messages is not a prefix of the text
            ends.append(old(k) if not whole else None)
            continue
        end_char = c + len(tail)
        j = bisect.bisect_left(starts, end_char)  # the tokens that start before the rendering's end
        straddles = j > 0 and spans[j - 1][1] > end_char
        if straddles or j < at_token or tokenize(text[at_char:end_char]) != list(prompt[at_token:j]):
            ends.append(old(k))  # the tokenization is not stable at this end: ask the rule itself
            continue
        ends.append(j)
        at_char, at_token = end_char, j
    return _kept(ends, prompt, below)


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

    def render(part: Sequence[Mapping[str, Any]]) -> str:
        try:
            return str(tokenizer.apply_chat_template(list(part), tokenize=False, **partial))
        except Exception as exc:
            raise KVStateError(
                f"chat_boundaries: the tokenizer's chat template could not render the first {len(part)} message(s) "
                f"({exc}); pass a tokenizer with a chat_template that accepts these messages."
            ) from exc

    def tokenize(text: str) -> list[int]:
        return [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]

    text, spans = "", None
    try:  # the offsets of the one tokenization (a tokenizer without them: every message found the old way)
        text = str(tokenizer.apply_chat_template(list(messages), tokenize=False, **template_kwargs))
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        if [int(i) for i in enc["input_ids"]] == full:
            spans = [(int(a), int(b)) for a, b in enc["offset_mapping"]]
    except Exception:
        spans = None
    boundaries = find_message_ends(messages, text, full, spans, render, tokenize, {}, whole=False)
    return torch.tensor([full], dtype=torch.long), boundaries
