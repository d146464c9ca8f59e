"""Chat prompts: rendering messages with a chat template, and the token positions where each message ends.

The model's own chat template is used when its tokenizer has one. The committed reference models have
none; they get :data:`DEFAULT_CHAT_TEMPLATE`, one line per message ``ROLE : CONTENT <eos>`` after
``<bos>`` and ``assistant :`` as the generation prompt, written so that the tokens of turn k+1's prompt
extend turn k's prompt plus its reply (the reply is what the prefix cache stores after generation).

Message ends are the natural checkpoint positions of a conversation (the system prompt's end is shared
by every conversation; each message's end is where the next turn resumes). They are found by rendering
growing prefixes of the message list and keeping the lengths whose tokens are a prefix of the whole
prompt's (a template that rewrites earlier messages when more follow yields fewer positions, never
wrong ones).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jinja2.exceptions import TemplateError

from kvstate.serve.protocol import RequestError

DEFAULT_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {{ eos_token }} {% endfor %}"
    "{% if add_generation_prompt %}assistant :{% endif %}"
)


def template_of(tokenizer: Any, override: str | None = None) -> str:
    """The template to render with: ``override``, else the tokenizer's, else :data:`DEFAULT_CHAT_TEMPLATE`."""
    return override or getattr(tokenizer, "chat_template", None) or DEFAULT_CHAT_TEMPLATE


def render(tokenizer: Any, template: str, messages: Sequence[dict[str, str]], generation_prompt: bool) -> list[int]:
    """Token ids of ``messages`` rendered by ``template`` (special tokens come from the template's text)."""
    try:
        text = tokenizer.apply_chat_template(
            list(messages), chat_template=template, add_generation_prompt=generation_prompt, tokenize=False
        )
    except (TemplateError, ValueError, TypeError, KeyError, IndexError) as exc:
        raise RequestError(f"messages: the chat template rejects this message list ({exc}); check the roles and "
                           "their order", param="messages") from None
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def message_ends(tokenizer: Any, template: str, messages: Sequence[dict[str, str]], prompt: Sequence[int]) -> list[int]:
    """Positions in ``(0, len(prompt) - 1)`` where a message of ``messages`` ends in ``prompt``'s tokens."""
    n = len(prompt)
    out: list[int] = []
    for k in range(1, len(messages) + 1):
        try:
            ids = render(tokenizer, template, messages[:k], generation_prompt=False)
        except RequestError:  # some templates refuse a conversation that ends on a system or user message
            continue
        if 0 < len(ids) < n - 1 and list(prompt[: len(ids)]) == ids and (not out or len(ids) > out[-1]):
            out.append(len(ids))
    return out
