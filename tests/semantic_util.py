"""SEKV configurations for tests of the store's mechanics (not the shipped default)."""

from __future__ import annotations

from typing import Any

from kvstate.semantic.config import SemanticConfig
from kvstate.semantic.segment import SegmentConfig


def lowrank_config(**kw: Any) -> SemanticConfig:
    """A :class:`SemanticConfig` with the low-rank slow tier, summary entries for unexpanded spans, expand share
    0.5 and the default segmentation — the mechanics these tests check; any keyword overrides. The shipped default
    (``SemanticConfig()``: 4-bit slow tier, expanded spans read alone) is checked in tests/lab/test_defaults.py."""
    base: dict[str, Any] = {"slow": "lowrank", "expand_share": 0.5, "summaries": True, "segment": SegmentConfig()}
    return SemanticConfig(**{**base, **kw})
