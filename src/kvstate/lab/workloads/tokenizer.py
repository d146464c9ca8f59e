"""The word-level tokenizer of the synthetic language (:mod:`kvstate.lab.workloads.language`).

A ``tokenizers`` WordLevel model over the language's fixed vocabulary, split on whitespace only
(``WhitespaceSplit``: punctuation is already its own space-separated word, and a regex pre-tokenizer
would glue nothing but could split future tokens such as ``bright-eyed``), wrapped as a transformers
``PreTrainedTokenizerFast`` so ``save_pretrained(dir)`` / ``AutoTokenizer.from_pretrained(dir)``
round-trips offline. Ids are the vocabulary order: ``<pad>=0, <bos>=1, <eos>=2, <unk>=3``, digits
``0-9`` at 4-13, so every build gives the same ids.

Encoding prepends ``<bos>`` (a post-processor; pass ``add_special_tokens=False`` for the bare
tokens) and never appends ``<eos>``: the answer format ends in `` .`` and models trained by
:func:`kvstate.lab.workloads.tasks.training_batch` learn to emit ``<eos>`` after it. Decoding joins tokens
with single spaces and ``clean_up_tokenization_spaces=False``, so ``decode(encode(t)) == t`` for any
text of the language (single-spaced, no leading or trailing space).
"""

from __future__ import annotations

from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from kvstate.lab.workloads.language import SPECIAL_TOKENS, vocabulary

PAD, BOS, EOS, UNK = SPECIAL_TOKENS


def build_tokenizer() -> PreTrainedTokenizerFast:
    """The language's tokenizer; identical ids on every call and every run."""
    vocab = {word: i for i, word in enumerate(vocabulary())}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        clean_up_tokenization_spaces=False,
        model_input_names=["input_ids", "attention_mask"],
    )


def count_tokens(tokenizer: PreTrainedTokenizerBase, text: str) -> int:
    """Tokens of ``text`` without special tokens (what :class:`~kvstate.lab.workloads.tasks.Example` counts)."""
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])
