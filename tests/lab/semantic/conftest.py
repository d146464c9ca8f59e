"""Shared fixtures of the resolution benchmark's tests."""

import pytest

from kvstate.lab.workloads import build_tokenizer
from kvstate.models import tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random-weight qwen3 saved with its tokenizer: (directory, model, tokenizer)."""
    tok = build_tokenizer()
    model = tiny_model("qwen3", vocab_size=len(tok))
    d = tmp_path_factory.mktemp("tiny")
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d, model, tok
