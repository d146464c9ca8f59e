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

A message's text may not contain a control token of the tokenizer (a special token's string such as
``<eos>`` or ``<bos>``): the rendered text is tokenized with special tokens recognized, so typed text
would become the real token and could close its own turn and forge another (``<eos> assistant : ...``).
Such a message is refused (400, naming the message and the token) rather than escaped: escaping would
tokenize message texts apart from the template's text, changing the tokens of every chat prompt at each
boundary (and a vocabulary that also holds the string as a word would still yield the control id), while
refusing leaves every accepted prompt's tokens, message ends and cached replies exactly as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jinja2.exceptions import TemplateError

from kvstate.prefix.chat import message_ends_in
from kvstate.serve.protocol import RequestError

DEFAULT_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {{ eos_token }} {% endfor %}"
    "{% if add_generation_prompt %}assistant :{% endif %}"
)


def template_of(tokenizer: Any, override: str | None = None) -> str:
    """The template to render with: ``override``, else the tokenizer's, else :data:`DEFAULT_CHAT_TEMPLATE`."""
    return override or getattr(tokenizer, "chat_template", None) or DEFAULT_CHAT_TEMPLATE


def control_tokens(tokenizer: Any) -> tuple[str, ...]:
    """The strings ``tokenizer`` turns into special tokens (``<eos>``, ``<|im_end|>``, ...), longest first."""
    found = set(getattr(tokenizer, "all_special_tokens", None) or ())
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    found.update(t.content for t in added.values() if getattr(t, "special", False))
    return tuple(sorted((t for t in found if t), key=lambda t: (-len(t), t)))


def check_contents(messages: Sequence[dict[str, str]], controls: Sequence[str]) -> None:
    """A :class:`RequestError` naming the first message whose text contains one of ``controls`` and the token."""
    for i, m in enumerate(messages):
        hit = next((c for c in controls if c in m["content"]), None)
        if hit is not None:
            raise RequestError(f"messages[{i}].content contains {hit!r}, a control token of this model's tokenizer "
                               "(it would end or start a turn); remove it from the message's text",
                               param=f"messages.{i}.content")


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
    """Positions in ``(0, len(prompt) - 1)`` where a message of ``messages`` ends in ``prompt``'s tokens
    (the rule is :func:`kvstate.prefix.chat.message_ends_in`, whole renderings only)."""

    def rendered(k: int) -> list[int] | None:
        try:
            return render(tokenizer, template, messages[:k], generation_prompt=False)
        except RequestError:  # some templates refuse a conversation that ends on a system or user message
            return None

    return message_ends_in((rendered(k) for k in range(1, len(messages) + 1)), prompt, whole=True,
                           below=len(prompt) - 1)
