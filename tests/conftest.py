"""Shared fixtures: tiny random-weight models of every supported family (built once per session)."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import settings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
# CI replays the same examples every run (a landing is never decided by which inputs were drawn); locally
# hypothesis keeps drawing new ones, which is how it finds what a fixed list misses
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

from kvstate.models import tiny_model  # noqa: E402

FAMILIES = ["llama", "qwen3", "qwen3_5", "qwen3_next", "mamba2", "bamba", "falcon_h1"]
RECURRENT_FAMILIES = ["qwen3_5", "qwen3_next", "mamba2", "bamba", "falcon_h1"]

_models: dict[tuple[str, torch.dtype], object] = {}


def get_model(family: str, dtype: torch.dtype = torch.float32):
    key = (family, dtype)
    if key not in _models:
        _models[key] = tiny_model(family, seed=0, dtype=dtype)
    return _models[key]


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


def random_ids(n: int, vocab: int = 128, seed: int = 0, batch: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, n), generator=g)
