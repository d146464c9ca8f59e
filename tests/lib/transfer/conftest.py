"""Shared by the transfer tests: every module runs on one torch thread (calibration and the maps are many small ops;
on a busy 2-core machine two threads only contend), and :func:`prompts`, random token prompts for the tiny models."""

from __future__ import annotations

import pytest
import torch


def prompts(n: int = 8, t: int = 48, seed: int = 0) -> list[torch.Tensor]:
    """``n`` prompts (1, ``t``) of random ids below 128, drawn from one generator seeded ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (1, t), generator=g) for _ in range(n)]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():  # type: ignore[no-untyped-def]
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
