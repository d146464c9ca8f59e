"""chat_boundaries: declared boundaries from a chat template, with a tokenizer built here (no hub download)."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from kvstate.errors import KVStateError
from kvstate.models import segmented_prefill
from kvstate.prefix import SparsePrefixCache, chat_boundaries
from tests.conftest import get_model

TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)
SPECIAL = ["[UNK]", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]


def _tokenizer(template: str | None = TEMPLATE) -> PreTrainedTokenizerFast:
    vocab = {w: i for i, w in enumerate([*SPECIAL, *(f"w{i}" for i in range(100))])}  # 105 ids < the tiny vocab
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    if template is not None:
        fast.chat_template = template
    return fast


def _words(start: int, n: int) -> str:
    return " ".join(f"w{(start + i) % 100}" for i in range(n))


def test_boundaries_are_the_ends_of_the_system_prompt_and_of_each_message():
    tok = _tokenizer()
    messages = [
        {"role": "system", "content": _words(0, 6)},
        {"role": "user", "content": _words(10, 3)},
        {"role": "assistant", "content": _words(20, 2)},
        {"role": "user", "content": _words(30, 4)},
    ]
    ids, bounds = chat_boundaries(tok, messages, add_generation_prompt=True)
    # each message renders as <|role|> words <|end|>; the generation prompt adds <|assistant|>
    assert bounds == [8, 8 + 5, 8 + 5 + 4, 8 + 5 + 4 + 6]
    assert ids.shape == (1, bounds[-1] + 1) and ids.dtype == torch.long
    end = tok.convert_tokens_to_ids("<|end|>")
    assert all(int(ids[0, b - 1]) == end for b in bounds)
    assert int(ids[0, -1]) == tok.convert_tokens_to_ids("<|assistant|>")
    ids2, bounds2 = chat_boundaries(tok, messages)  # no generation prompt: the last boundary is the end
    assert bounds2 == bounds and ids2.shape[1] == bounds[-1]


def test_bad_calls_are_one_clear_error():
    tok = _tokenizer()
    with pytest.raises(KVStateError, match="messages is empty"):
        chat_boundaries(tok, [])
    with pytest.raises(KVStateError, match="tokenize"):
        chat_boundaries(tok, [{"role": "user", "content": "w1"}], tokenize=False)
    with pytest.raises(KVStateError, match="chat_template"):
        chat_boundaries(_tokenizer(template=None), [{"role": "user", "content": "w1"}])


def test_a_chat_served_with_its_boundaries_resumes_after_the_system_prompt():
    model = get_model("qwen3_5")
    tok = _tokenizer()
    system = {"role": "system", "content": _words(0, 150)}  # a long shared system prompt / document
    cache = SparsePrefixCache(model, budget_bytes=64 << 20)
    reqs = []
    for q in (40, 70):
        ids, bounds = chat_boundaries(tok, [system, {"role": "user", "content": _words(q, 5)}],
                                      add_generation_prompt=True)
        reqs.append((ids, bounds, cache.prefill(ids, boundaries=bounds)))
    (_, bounds, first), (ids, _, second) = reqs
    assert first.reused_tokens == 0 and second.reused_tokens >= bounds[0] == 152
    torch.testing.assert_close(second.logits, segmented_prefill(model, ids).logits, atol=1e-4, rtol=0)


def test_one_rule_for_message_ends_whole_renderings_or_their_common_prefix():
    from kvstate.prefix.chat import message_ends_in

    prompt = [1, 5, 6, 2, 7, 8, 2, 9]
    renderings = [[1, 5, 6, 2], None, [1, 5, 6, 2, 7, 8, 3], [1, 5, 6, 2, 7, 8, 2]]  # the 3rd closes differently
    assert message_ends_in(renderings, prompt, whole=True) == [4, 7]
    assert message_ends_in(renderings, prompt, whole=False) == [4, 6, 7]
    assert message_ends_in(renderings, prompt, whole=True, below=len(prompt) - 1) == [4]  # the server's bound
    assert message_ends_in([[9], [1, 5]], prompt, whole=False) == [2]  # no agreement: no position
