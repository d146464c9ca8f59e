"""Depth properties that hold by construction are checks, and the committed R-CLA model's declared family really
holds more than one keep-0.5 pattern (the property its check row shows)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstate.depth.patterns import LayerSpec, format_pattern
from kvstate.lab.depth.evaluate import family_plan

REPO = Path(__file__).resolve().parents[3]
RCLA_STATE = REPO / "models" / "ref-attn-rcla" / "training_state.json"


@pytest.mark.skipif(not RCLA_STATE.is_file(), reason="no committed models/ref-attn-rcla")
def test_the_committed_rcla_family_holds_at_least_two_keep_half_patterns():
    state = json.loads(RCLA_STATE.read_text())
    depth = state["depth"]
    layers = [LayerSpec("full_attention", 2, 16)] * len(depth["p_layer"])
    _, patterns, how = family_plan(depth, layers, 0.5)
    names = [format_pattern(p) for p in patterns]
    assert how == "declared" and len(set(names)) >= 2 and "0_0_2_2" in names, (how, names)
    assert sorted(names) == sorted(depth["family"]["by_keep"]["0.5"]), names  # what its training recorded
