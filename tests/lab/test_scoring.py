"""RULER-style scoring: hand-worked cases for each metric and the dispatch."""

from dataclasses import dataclass

import pytest

from kvstate.lab.scoring import exact_match, extract_answer, f1, normalize, score, string_match_all


@dataclass(frozen=True)
class Stub:
    task: str
    answers: tuple[str, ...]
    metric: str


def test_normalize_is_squad_style():
    assert normalize("The  Grey Cat .") == "grey cat"
    assert normalize("KAV , ZOT") == "kav zot"
    assert normalize("an apple, a pear!") == "apple pear"
    assert normalize("theory") == "theory"  # articles only as whole words


def test_extract_answer_cuts_at_the_end_marker():
    assert extract_answer("4 2 7 . the river flowed .") == "4 2 7"
    assert extract_answer(" grey cat<eos>junk") == "grey cat"
    assert extract_answer("rye bread\nQuestion: what") == "rye bread"
    assert extract_answer("no marker") == "no marker"
    assert extract_answer(". 4 2 7") == ""


def test_exact_match():
    assert exact_match("4 2 7 .", ["4 2 7"]) == 1.0
    assert exact_match("4 2 7 1", ["4 2 7"]) == 0.0
    assert exact_match("the Glass Maker", ["glass maker"]) == 1.0
    assert exact_match("9 9", ["1 1", "9 9"]) == 1.0
    assert exact_match("", ["4"]) == 0.0


def test_string_match_all_counts_answers_found():
    assert string_match_all("KAV , ZOT .", ["KAV", "ZOT", "MIB"]) == pytest.approx(2 / 3)
    assert string_match_all("kav zot mib", ["KAV", "ZOT", "MIB"]) == 1.0
    assert string_match_all("catalog", ["cat"]) == 0.0  # whole words, not raw substrings
    assert string_match_all("1 2 3 4 , 5 6 7 8", ["2 3 4", "5 6 7 8"]) == 1.0
    assert string_match_all("nothing", ["a1", "b2"]) == 0.0


def test_f1_token_level_max_over_answers():
    assert f1("grey cat", ["grey cat"]) == 1.0
    assert f1("a grey dog", ["grey cat"]) == pytest.approx(0.5)  # p = 1/2, r = 1/2
    assert f1("grey", ["grey cat"]) == pytest.approx(2 / 3)  # p = 1, r = 1/2
    assert f1("grey cat", ["white dog", "grey cat"]) == 1.0
    assert f1("cat cat", ["cat"]) == pytest.approx(2 / 3)  # p = 1/2 (counts clip), r = 1
    assert f1("", ["cat"]) == 0.0
    assert f1("the", ["a"]) == 1.0  # both normalise to nothing: SQuAD scores agreement


def test_score_dispatches_on_metric_and_cuts_prediction():
    assert score(Stub("niah_single", ("4 2 7",), "exact"), "4 2 7 . the ship sailed") == 1.0
    assert score(Stub("niah_single", ("4 2 7",), "exact"), "4 2 7 1 .") == 0.0
    assert score(Stub("vt", ("KAV", "ZOT"), "all"), "KAV . ZOT") == 0.5  # ZOT came after the end marker
    assert score(Stub("qa", ("grey cat",), "f1"), "grey dog .") == pytest.approx(0.5)


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match=r"metric 'ppl'.*perplexity"):
        score(Stub("text", (), "ppl"), "anything")
    with pytest.raises(ValueError, match="answers=\\[\\] must be a non-empty list"):
        exact_match("x", [])
    with pytest.raises(ValueError, match="wrap a single answer"):
        f1("x", "cat")
    with pytest.raises(ValueError, match="string_match_all"):
        string_match_all("x", ())
