"""Workload generators (deterministic, shaped as documented) and the JSONL trace format."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from kvstate.errors import TraceFormatError
from kvstate.lab.workloads.traces import (
    WORKLOADS,
    Request,
    generate,
    overlap_weights,
    read_trace,
    write_trace,
)


@pytest.mark.parametrize("workload", WORKLOADS)
def test_deterministic_by_seed_and_overlaps_are_true_prefixes(workload):
    a = generate(workload, 40, seed=3, scale=0.05)
    assert a == generate(workload, 40, seed=3, scale=0.05)
    assert a != generate(workload, 40, seed=4, scale=0.05)
    seen: dict[str, list[tuple[int, ...]]] = {}
    for r in a:
        assert r.length == len(r.tokens) and 0 <= r.overlap <= r.length
        lcps = [next((i for i, (x, y) in enumerate(zip(p, r.tokens, strict=False)) if x != y), min(len(p), r.length))
                for p in seen.get(r.prefix_id, [])]
        assert r.overlap == max(lcps, default=0)  # the overlap is the real longest shared prefix
        seen.setdefault(r.prefix_id, []).append(r.tokens)


def test_quality_is_bimodal_with_about_60_percent_zero_overlap():
    reqs = generate("quality", 2000, seed=0, scale=0.01)
    zero = np.mean([r.overlap == 0 for r in reqs])
    assert 0.5 < zero < 0.7
    nonzero = [r for r in reqs if r.overlap]
    assert all(r.length - r.overlap <= 60 for r in nonzero)  # overlap = the whole document


def test_chat_is_append_only():
    reqs = generate("chat", 30, seed=1, scale=0.1)
    for prev, r in itertools.pairwise(reqs):
        if r.prefix_id == prev.prefix_id:
            assert r.overlap == prev.length and r.tokens[: prev.length] == prev.tokens


def test_round_trip_and_weights(tmp_path):
    reqs = generate("system_prompts", 20, seed=2, scale=0.05)
    write_trace(tmp_path / "t.jsonl", reqs)
    assert read_trace(tmp_path / "t.jsonl") == reqs
    w = overlap_weights(reqs, "sys-0")
    assert w.sum() == sum(r.prefix_id == "sys-0" for r in reqs)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{bad json", "t.jsonl:2: not valid JSON"),
        ("[1, 2]", "t.jsonl:2: expected a JSON object"),
        ('{"overlap": 5, "length": 3}', "t.jsonl:2: overlap 5 exceeds length 3"),
        ('{"tokens": [1, -2]}', "t.jsonl:2: 'tokens' must be"),
        ('{"prefix_id": "a"}', "t.jsonl:2: needs 'tokens'"),
        ('{"overlap": -1, "length": 3}', "t.jsonl:2: 'overlap' must be a non-negative int"),
    ],
)
def test_bad_lines_name_the_line(tmp_path, line, message):
    p = tmp_path / "t.jsonl"
    p.write_text('{"prefix_id": "a", "overlap": 0, "length": 4}\n' + line + "\n")
    with pytest.raises(TraceFormatError, match=message.replace("[", r"\[")):
        read_trace(p)


def test_overlap_only_lines_parse(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text('# comment\n{"prefix_id": "d", "overlap": 7, "length": 9}\n\n')
    assert read_trace(p) == [Request(None, "d", 7, 9)]
