"""Chat prompts: rendering messages with a chat template, and the token positions where each message ends.

The model's own chat template is used when its tokenizer has one. The committed reference models have
none; they get :data:`DEFAULT_CHAT_TEMPLATE`, one line per message ``ROLE : CONTENT <eos>`` after
``<bos>`` and ``assistant :`` as the generation prompt, written so that the tokens of turn k+1's prompt
extend turn k's prompt plus its reply (the reply is what the prefix cache stores after generation).

Message ends are the natural checkpoint positions of a conversation (the system prompt's end is shared
by every conversation; each message's end is where the next turn resumes). A message ends where the
rendering of the messages up to it ends, when its tokens are a prefix of the whole prompt's (a template
that rewrites earlier messages when more follow yields fewer positions, never wrong ones); they are found
in time linear in the messages (:func:`kvstate.prefix.chat.find_message_ends`: each message rendered once,
each role's closing text learned once per tokenizer), not by rendering every prefix.

A message's text may not contain a control token of the tokenizer (a special token's string such as
``<eos>`` or ``<bos>``): the rendered text is tokenized with special tokens recognized, so typed text
would become the real token and could close its own turn and forge another (``<eos> assistant : ...``).
Such a message is refused (400, naming the message and the token) rather than escaped: escaping would
tokenize message texts apart from the template's text, changing the tokens of every chat prompt at each
boundary (and a vocabulary that also holds the string as a word would still yield the control id), while
refusing leaves every accepted prompt's tokens, message ends and cached replies exactly as before.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from jinja2.exceptions import TemplateError

from kvstate.prefix.chat import find_message_ends
from kvstate.serve.protocol import RequestError

DEFAULT_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {{ eos_token }} {% endfor %}"
    "{% if add_generation_prompt %}assistant :{% endif %}"
)


_SPACE = {c: None for c in range(0x3001) if chr(c).isspace()}  # every whitespace character (none lies past U+3000)


class CharBound:
    """The fewest tokens a text can become under one tokenizer, without tokenizing it: no token covers more
    characters than its vocabulary's longest entry (a byte-level or SentencePiece entry spells at least the
    characters it covers), so ``n`` characters are at least ``n / longest`` tokens. Computed once per tokenizer.
    A tokenizer that drops whitespace (a whitespace pre-tokenizer) is counted on the other characters; one with
    a normalizer (which may merge characters) or without a vocabulary listing gets a slack of 4 or no bound.
    Ignores: normalizers that delete other characters outright (the bound may then refuse a prompt that fits)."""

    def __init__(self, tokenizer: Any) -> None:
        try:
            vocab = tokenizer.get_vocab()
            self.longest: int | None = max((len(t) for t in vocab), default=0) or None
        except (AttributeError, NotImplementedError, TypeError):
            self.longest = None
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if self.longest is not None and (backend is None or backend.normalizer is not None):
            self.longest *= 4
        spaces = 64
        self.drops_space = self.longest is not None and \
            len(tokenizer(" " * spaces, add_special_tokens=False)["input_ids"]) * self.longest < spaces

    def least_tokens(self, text: str, positions: int) -> int:
        """A lower bound on ``text``'s tokens (0 when the text could fit ``positions`` whatever it holds)."""
        if self.longest is None or len(text) < positions * self.longest:
            return 0
        n = len(text.translate(_SPACE)) if self.drops_space else len(text)
        return -(-n // self.longest)


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


def render_text(tokenizer: Any, template: str, messages: Sequence[Mapping[str, Any]], generation_prompt: bool) -> str:
    """The text ``template`` renders ``messages`` to (a :class:`RequestError` when it refuses them)."""
    try:
        text = tokenizer.apply_chat_template(
            list(messages), chat_template=template, add_generation_prompt=generation_prompt, tokenize=False
        )
    except (TemplateError, ValueError, TypeError, KeyError, IndexError) as exc:
        raise RequestError(f"messages: the chat template rejects this message list ({exc}); check the roles and "
                           "their order", param="messages") from None
    return str(text)


def encode(tokenizer: Any, text: str, limit: int | None = None) -> tuple[list[int], list[tuple[int, int]] | None]:
    """Token ids of rendered ``text`` (special tokens come from the template's text), at most ``limit`` of them,
    and the span of text each covers (None: the tokenizer gives no offsets)."""
    cut: dict[str, Any] = {} if limit is None else {"truncation": True, "max_length": limit}
    try:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, **cut)
        return list(enc["input_ids"]), [(int(a), int(b)) for a, b in enc["offset_mapping"]]
    except NotImplementedError:  # a slow (Python) tokenizer has no offsets
        return list(tokenizer(text, add_special_tokens=False, **cut)["input_ids"]), None


def render(tokenizer: Any, template: str, messages: Sequence[Mapping[str, Any]], generation_prompt: bool) -> list[int]:
    """Token ids of ``messages`` rendered by ``template`` (special tokens come from the template's text)."""
    return encode(tokenizer, render_text(tokenizer, template, messages, generation_prompt))[0]


def message_ends(tokenizer: Any, template: str, messages: Sequence[Mapping[str, Any]], prompt: Sequence[int],
                 text: str | None = None, spans: Sequence[tuple[int, int]] | None = None,
                 tails: dict[str, str | None] | None = None) -> list[int]:
    """Positions in ``(0, len(prompt) - 1)`` where a message of ``messages`` ends in ``prompt``'s tokens (the
    rule is :func:`kvstate.prefix.chat.message_ends_in`, whole renderings only), in time linear in the messages.
    ``text`` / ``spans``: the prompt's rendered text and each token's span in it (:func:`encode`; default: found
    here); ``tails``: each role's closing text, kept by the caller per tokenizer and template."""
    if text is None:
        text = render_text(tokenizer, template, messages, generation_prompt=True)
        ids, spans = encode(tokenizer, text)
        if ids != list(prompt):
            text, spans = "", None

    def rendered(part: Sequence[Mapping[str, Any]]) -> str | None:
        try:
            return render_text(tokenizer, template, part, generation_prompt=False)
        except RequestError:  # some templates refuse a conversation that ends on a system or user message
            return None

    def tokenize(part: str) -> list[int]:
        return list(tokenizer(part, add_special_tokens=False)["input_ids"])

    return find_message_ends(messages, text, prompt, spans, rendered, tokenize, {} if tails is None else tails,
                             whole=True, below=len(prompt) - 1)
