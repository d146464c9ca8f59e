"""Fixtures the lab's tests share."""

from __future__ import annotations

import pytest

from kvstate.lab import ledger as L


@pytest.fixture
def models(tmp_path, monkeypatch):
    """A results root under ``tmp_path`` with the seed ledger pointed at it (folders ``m/`` and ``smollm2/``)."""
    root = tmp_path / "models"
    for sub in ("m", "smollm2"):
        (root / sub).mkdir(parents=True)
    monkeypatch.setattr(L, "results_root", lambda: root)
    return root
