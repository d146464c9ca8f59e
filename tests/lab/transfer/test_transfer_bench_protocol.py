"""The transfer bench under the measurement protocol: scores pool only the tasks the oracle solves at each
length, the rest are shown beside; ``--methods`` takes registered names only."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from kvstate.cli import app
from kvstate.errors import KVStateError
from kvstate.lab.transfer.bench import BenchConfig, summarize


def test_scores_pool_only_the_tasks_the_oracle_solves_at_that_length() -> None:
    cells = {
        "oracle": {"a": {1024: [1.0] * 10, 4096: [1.0] * 8 + [0.0] * 2}, "b": {1024: [1.0] * 9 + [0.0], 4096: [1.0] * 10}},
        "raw": {"a": {1024: [0.0] * 10, 4096: [1.0] * 10}, "b": {1024: [1.0] * 10, 4096: [0.5] * 10}},
    }
    got = summarize(cells, "oracle", (1024, 4096))
    r1, r4 = got[("raw", 1024)], got[("raw", 4096)]
    assert r1["tasks"] == ["a", "b"] and r1["excluded_tasks"] == {} and r1["n"] == 20 and r1["score"] == 0.5
    # at 4K the oracle's 0.8 on task a is below 0.9: a is excluded, shown beside with the oracle's score
    assert r4["tasks"] == ["b"] and r4["excluded_tasks"] == {"a": 0.8} and r4["n"] == 10 and r4["score"] == 0.5
    assert r4["by_task"]["a"] == {"score": 1.0, "n": 10, "items": [1.0] * 10}  # every task kept per task
    assert r4["score_ci"][0] < 0.5 < r4["score_ci"][1] and got[("oracle", 4096)]["score"] == 1.0
    nothing = summarize({"oracle": {"a": {64: [0.0, 1.0]}}, "raw": {"a": {64: [1.0, 1.0]}}}, "oracle", (64,))
    assert nothing[("raw", 64)]["score"] is None and nothing[("raw", 64)]["n"] == 0


def test_bench_methods_must_be_registered_and_one_line_lists_them() -> None:
    with pytest.raises(KVStateError, match="--methods 'zip' is not a transfer method; pick one of oracle, raw"):
        BenchConfig(methods=("zip",))
    res = CliRunner().invoke(app, ["transfer", "bench", "--methods", "raw,zip", "--codec", "/nonexistent"])
    assert isinstance(res.exception, KVStateError) and "zip" in str(res.exception) and "raw" in str(res.exception)
    assert BenchConfig().lengths == (1024, 2048)  # the lengths the consumer solves (tests/lab/test_defaults.py)


def test_methods_lists_the_registry() -> None:
    import json

    from kvstate.transfer import methods as registry

    res = CliRunner().invoke(app, ["transfer", "methods", "--json"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.output.strip().splitlines()[-1])
    assert [r["method"] for r in rows] == list(registry.names())
    assert {r["method"]: r["options"] for r in rows}["droidspeak"] == ["block"]
    assert [r["method"] for r in rows if not r["ships_payload"]] == ["oracle"]
