"""A depth model's label in the report says what its training did: per-layer routing probabilities and how much
of the keep-0.5 pattern space its declared family covers (issue 42), counted by brute force."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

from kvstate.lab.depth.section import LABELS, _patterns_at, describe


def _brute(n: int, owners: int) -> int:
    """Every map layer -> the layer whose K/V it reads, layer 0 its own, a reader of an earlier owner."""
    count = 0
    for reads in itertools.product(*(range(i + 1) for i in range(n))):
        own = {i for i in range(n) if reads[i] == i}
        if reads[0] == 0 and len(own) == owners and all(reads[i] in own for i in range(n)):
            count += 1
    return count


def test_the_pattern_count_equals_brute_force() -> None:
    for n in range(1, 7):
        for k in range(1, n + 1):
            assert _patterns_at(n, k) == _brute(n, k)
    assert _patterns_at(4, 2) == 7


def _state(tmp: Path, name: str, depth: dict) -> Path:
    (tmp / name).mkdir()
    (tmp / name / "training_state.json").write_text(json.dumps({"depth": depth}))
    return tmp


def test_a_model_is_labelled_by_its_training_not_by_its_directory(tmp_path: Path) -> None:
    _state(tmp_path, "ref-attn-rcla", {"p_layer": [1.0, 0.5, 1.0, 0.5],
                                       "family": {"by_keep": {"0.5": ["0_0_2_0", "0_0_2_2"]}}})
    _state(tmp_path, "ref-attn-rcla075", {"p": 0.75})
    _state(tmp_path, "ref-attn-kv1", {"p": 1.0})
    assert describe(tmp_path, "ref-attn-rcla") == "R-CLA, per-layer p = 1, 0.5, 1, 0.5; 2 of 7 keep-0.5 patterns"
    assert describe(tmp_path, "ref-attn-rcla075") == "R-CLA, p = 0.75 on every layer"
    assert describe(tmp_path, "ref-attn-kv1") == LABELS["ref-attn-kv1"]  # never routed: its own label
    assert describe(tmp_path, "ref-attn-cla2") == LABELS["ref-attn-cla2"]  # no training state: the fallback
