"""Message ends found in linear time equal the rule computed by rendering every prefix (the written-out
reference below), on chat shapes a server sees, for a word-level and a byte-level BPE tokenizer and several
templates (one that trims contents, one that adds a default system prompt); and the work is linear."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from kvstate.prefix.chat import chat_boundaries, message_ends_in
from kvstate.serve.chat import DEFAULT_CHAT_TEMPLATE, message_ends, render
from tests.lib.serve.conftest import word_tokenizer

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TRIMMED = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }} : {{ m['content'] | trim }} {{ eos_token }} "
           "{% endfor %}{% if add_generation_prompt %}assistant :{% endif %}")
DEFAULT_SYSTEM = ("{% if messages[0]['role'] != 'system' %}<|im_start|>system\nw1 w2<|im_end|>\n{% endif %}" + CHATML)


def _bpe() -> PreTrainedTokenizerFast:
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    words = ["the cat sat on the mat.", "What is the capital of France?", "Paris is.", "hello world", "w1 w2 w3"]
    core.train_from_iterator(words * 20, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|im_start|>", "<|im_end|>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>")


def _reference(tok: Any, template: str, messages: Sequence[dict[str, str]], prompt: Sequence[int]) -> list[int]:
    """The rule as first written: render and tokenize every prefix of the message list."""
    def rendered(k: int) -> list[int] | None:
        try:
            text = tok.apply_chat_template(list(messages[:k]), chat_template=template, tokenize=False,
                                           add_generation_prompt=False)
        except Exception:
            return None
        return list(tok(text, add_special_tokens=False)["input_ids"])
    return message_ends_in((rendered(k) for k in range(1, len(messages) + 1)), prompt, whole=True,
                           below=len(prompt) - 1)


def _words(bpe: bool, i: int, n: int) -> str:
    pool = ["the cat", "sat on", "the mat.", "What is", "Paris", "hello", "world?"] if bpe else \
        [f"w{10 + j}" for j in range(40)]
    return " ".join(pool[(i + j) % len(pool)] for j in range(n))


def _shapes(bpe: bool) -> list[list[dict[str, str]]]:
    w = lambda i, n: _words(bpe, i, n)  # noqa: E731
    turns = [{"role": "user" if k % 2 == 0 else "assistant", "content": w(k, 1 + k % 3)} for k in range(9)]
    return [
        [{"role": "user", "content": w(0, 3)}],
        [{"role": "system", "content": w(1, 4)}, {"role": "user", "content": w(2, 2)}],
        [{"role": "system", "content": w(3, 2)}, *turns],
        turns,
        [{"role": "user", "content": w(4, 1)}, {"role": "assistant", "content": ""}, {"role": "user", "content": w(5, 2)}],
        [{"role": "user", "content": "  " + w(6, 2) + "  "}, {"role": "assistant", "content": w(7, 1) + " "},
         {"role": "user", "content": w(8, 1)}],
    ]


CASES = [("word", DEFAULT_CHAT_TEMPLATE), ("word", TRIMMED), ("bpe", CHATML), ("bpe", DEFAULT_SYSTEM)]


@pytest.mark.parametrize(("kind", "template"), CASES, ids=["word-default", "word-trim", "bpe-chatml", "bpe-system"])
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_linear_message_ends_equal_the_rule_rendered_prefix_by_prefix(kind: str, template: str,
                                                                     generation_prompt: bool) -> None:
    tok = word_tokenizer() if kind == "word" else _bpe()
    tails: dict[str, str | None] = {}
    for messages in _shapes(kind == "bpe"):
        prompt = render(tok, template, messages, generation_prompt=generation_prompt)
        want = _reference(tok, template, messages, prompt)
        assert message_ends(tok, template, messages, prompt, tails=tails) == want
        if generation_prompt and template == DEFAULT_CHAT_TEMPLATE:
            assert len(want) == len(messages)  # every message has its end: the comparison is not vacuous


def test_chat_boundaries_equal_the_common_prefix_rule() -> None:
    tok = _bpe()
    tok.chat_template = CHATML
    for messages in _shapes(True):
        ids, bounds = chat_boundaries(tok, messages, add_generation_prompt=True)
        renderings = [tok.apply_chat_template(messages[:k], tokenize=True, return_dict=False)
                      for k in range(1, len(messages) + 1)]
        assert bounds == message_ends_in(renderings, ids[0].tolist(), whole=False) and len(bounds) == len(messages)


def test_message_ends_render_each_message_a_bounded_number_of_times() -> None:
    tok = word_tokenizer()
    seen: list[int] = []
    apply = tok.apply_chat_template

    def counted(conversation: Any, **kw: Any) -> Any:
        seen.append(len(conversation))
        return apply(conversation, **kw)

    tok.apply_chat_template = counted  # type: ignore[method-assign]
    messages = [{"role": "user" if k % 2 == 0 else "assistant", "content": f"w{10 + k % 50}"} for k in range(401)]
    prompt = render(tok, DEFAULT_CHAT_TEMPLATE, messages, generation_prompt=True)
    seen.clear()
    ends = message_ends(tok, DEFAULT_CHAT_TEMPLATE, messages, prompt)
    assert len(ends) == 401 and sum(seen) <= 3 * len(messages) + 10  # the old rule rendered 80,601 messages
