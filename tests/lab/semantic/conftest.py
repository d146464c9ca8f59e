"""Shared fixtures of the resolution benchmark's tests."""

import os
from pathlib import Path

import pytest

from kvstate.lab.semantic.baselines_kvpress import ensure_env
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


KVPRESS_VENV = Path(__file__).resolve().parents[3] / ".venv-kvpress"


@pytest.fixture
def kvpress_python():
    """kvpress's own interpreter. `make test` creates .venv-kvpress; under CI its absence is a failure (a missing
    install step), elsewhere a skip."""
    if not (KVPRESS_VENV / "bin" / "python").is_file() and not os.environ.get("CI"):
        pytest.skip("no .venv-kvpress (kvpress's own env; `make test` creates it)")
    return ensure_env(KVPRESS_VENV, create=False)
