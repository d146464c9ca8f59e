"""The canary's bookkeeping: per-test outcomes from pytest's JUnit XML, the differences, the appended record."""

from __future__ import annotations

import json
from pathlib import Path

from kvstate.lab import canary

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.lib.models.test_models_state" name="test_a[qwen3_5]" time="0.1"/>
<testcase classname="tests.lib.models.test_models_state" name="test_b" time="0.1">
  <failure message="assert False&#10;  where False = equal(...)">trace</failure></testcase>
<testcase classname="tests.lib.serve.test_server" name="test_c" time="0.1"><skipped message="no redis"/></testcase>
<testcase classname="tests.lib.serve.test_server" name="test_d" time="0.1"><error message="fixture broke"/></testcase>
</testsuite></testsuites>"""


def test_junit_outcomes_and_one_line_reasons() -> None:
    got = canary.parse_junit(JUNIT)
    assert got == {
        "tests/lib/models/test_models_state.py::test_a[qwen3_5]": {"outcome": "passed", "reason": ""},
        "tests/lib/models/test_models_state.py::test_b": {"outcome": "failed",
                                                          "reason": "assert False where False = equal(...)"},
        "tests/lib/serve/test_server.py::test_c": {"outcome": "skipped", "reason": "no redis"},
        "tests/lib/serve/test_server.py::test_d": {"outcome": "error", "reason": "fixture broke"},
    }
    assert canary.summary(got) == {"passed": 1, "failed": 1, "error": 1, "skipped": 1}


def test_differences_name_each_test_whose_outcome_moved() -> None:
    lock = {"a": {"outcome": "passed", "reason": ""}, "b": {"outcome": "passed", "reason": ""}}
    new = {"a": {"outcome": "passed", "reason": ""}, "b": {"outcome": "failed", "reason": "KeyError: 'chunk_size'"},
           "c": {"outcome": "passed", "reason": ""}}
    assert canary.differences(lock, new) == [
        {"test": "b", "lock": "passed", "newest": "failed", "reason": "KeyError: 'chunk_size'"},
        {"test": "c", "lock": "absent", "newest": "passed", "reason": ""},
    ]


def test_records_are_appended_never_replaced(tmp_path: Path) -> None:
    path = tmp_path / "compat.json"
    canary.append({"date": "1"}, path)
    canary.append({"date": "2"}, path)
    assert [r["date"] for r in json.loads(path.read_text())["runs"]] == ["1", "2"]
    assert not list(tmp_path.glob("*.tmp"))


def test_the_subset_names_tests_that_exist() -> None:
    for entry in canary.SUBSET:
        path, _, name = entry.partition("::")
        source = (canary.REPO / path).read_text()
        assert not name or f"def {name}(" in source


def test_the_committed_record_shows_the_newest_canary_passed_on_the_tested_range() -> None:
    from kvstate.models import compat

    runs = json.loads(canary.RESULTS.read_text())["runs"]
    newest = runs[-1]
    assert newest["passed"] and newest["differences"] == []
    assert compat.in_tested_range(newest["newest"]["versions"]["transformers"])
    assert newest["newest"]["versions"]["transformers"].startswith(compat.TESTED[1] + ".")
