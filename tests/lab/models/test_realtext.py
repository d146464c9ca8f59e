"""Real-text needle tasks: deterministic items that fit their length, hold their needles, and score replies."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstate.lab.scoring import string_match_all
from kvstate.lab.workloads import realtext as rt
from tests.lab.models.test_real_model import MODEL, needs_model


@pytest.fixture(scope="module")
def tok():  # type: ignore[no-untyped-def]
    from kvstate.models.loading import load_tokenizer

    return load_tokenizer(MODEL)


def test_the_haystack_and_the_held_out_text_are_disjoint_files_of_one_source() -> None:
    assert not set(rt.HAYSTACK) & set(rt.HELD_OUT)
    hay, held = rt.haystack(), rt.held_out_text()
    assert len(hay) > 500 and len(held.split()) > 5000
    assert hay[0] not in held


def test_a_missing_source_is_one_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(rt.RealTextError, match=r"GPL-3 is missing.*base-files"):
        rt.haystack(tmp_path)


@needs_model
@pytest.mark.parametrize("task", rt.TASKS)
@pytest.mark.parametrize("length", [512, 2048])
def test_items_fit_their_length_hold_every_needle_and_repeat_exactly(tok, task: str, length: int) -> None:  # type: ignore[no-untyped-def]
    a, b = rt.make_item(tok, task, length, 5, 3), rt.make_item(tok, task, length, 5, 3)
    assert a == b and rt.make_item(tok, task, length, 5, 4) != a
    assert length - rt.FIT_SLACK <= len(a.prompt_ids) <= length
    text = tok.decode(list(a.prompt_ids))
    assert all(ans in text for ans in a.answers) and text.rstrip().endswith("assistant")
    assert string_match_all(" and ".join(a.answers), a.answers) == 1.0
    assert string_match_all("I do not know", a.answers) == 0.0


@needs_model
def test_a_length_too_short_for_the_question_is_refused(tok) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(rt.RealTextError, match="too short for niah_multiquery"):
        rt.make_item(tok, "niah_multiquery", 96, 5, 0)
    with pytest.raises(rt.RealTextError, match="not a real-text task"):
        rt.make_item(tok, "qa", 1024, 5, 0)
