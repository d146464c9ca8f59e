"""The one list parser: K suffixes, refused duplicates / empties / non-ASCII digits / out-of-range values."""

from __future__ import annotations

import pytest

from kvstate.errors import KVStateError
from kvstate.lab.lists import ListOptionError, parse_floats, parse_ints, parse_names


def test_ints_with_k_suffix():
    assert parse_ints("512,1K,2k, 4096", "--length") == [512, 1024, 2048, 4096]


@pytest.mark.parametrize(("value", "needles"), [
    ("1K,1024", ["--length", "'1024'", "more than once", "'1K' and '1024' are the same value"]),
    ("512,512", ["--length", "'512'", "more than once"]),
    ("", ["--length", "empty", "512,1K,4096"]),
    (" , ", ["--length", "empty item"]),
    ("512,,1024", ["--length", "empty item"]),
    ("²", ["--length", "'²'", "not a whole number", "512,1K,4096"]),
    ("1_000", ["'1_000'", "not a whole number"]),
    ("+5", ["'+5'", "not a whole number"]),
    ("١٢", ["not a whole number"]),  # Arabic-Indic digits: int() would take them
    ("1k5", ["'1k5'", "not a whole number"]),
    ("-1", ["'-1'", "out of range", ">= 1"]),
    ("0", ["'0'", "out of range"]),
])
def test_ints_refused(value, needles):
    with pytest.raises(ListOptionError) as info:
        parse_ints(value, "--length")
    assert isinstance(info.value, KVStateError)
    assert all(n in str(info.value) for n in needles), str(info.value)


def test_ints_range_bounds():
    assert parse_ints("0,8", "--slots", lo=0, hi=8) == [0, 8]
    with pytest.raises(ListOptionError, match=r"'9' = 9 is out of range: each value must be in \[0, 8\]"):
        parse_ints("0,9", "--slots", lo=0, hi=8)


def test_floats_parse_and_range():
    assert parse_floats("1,0.5,.25,1e-1", "--keep", lo=0, lo_open=True, hi=1) == [1.0, 0.5, 0.25, 0.1]
    for bad, needle in (("1.5", r"--keep '1.5' is out of range: each value must be in \(0, 1\]"),
                        ("0", "'0' is out of range"), ("-0.5", "'-0.5' is out of range"),
                        ("nan", "'nan' is not a decimal number"), ("inf", "not a decimal number"),
                        ("0.5,0.50", "'0.50' given more than once"), ("", "is empty")):
        with pytest.raises(ListOptionError, match=needle):
            parse_floats(bad, "--keep", lo=0, lo_open=True, hi=1)
    with pytest.raises(ListOptionError, match=r"in \[0, 1\]"):
        parse_floats("-0.1", "--p", lo=0, hi=1)


def test_names_choices_duplicates_and_order():
    assert parse_names("qa,niah_single", "--task", ["niah_single", "qa"]) == ["qa", "niah_single"]
    assert parse_names("SnapKVPress,full", "--methods") == ["SnapKVPress", "full"]
    with pytest.raises(ListOptionError, match="--task 'nope' is unknown; choose from niah_single, qa"):
        parse_names("nope", "--task", ["niah_single", "qa"])
    with pytest.raises(ListOptionError, match="--task: 'qa' given more than once"):
        parse_names("qa,qa", "--task", ["niah_single", "qa"])
    with pytest.raises(ListOptionError, match="--methods '' is empty"):
        parse_names("", "--methods")
