"""Numbers in docs/ are generated (issue 42): a results table in a page is a marked copy of a report table that
`make docs` refreshes, or a quoted dev-seed pilot naming its docs/results file; a hand-typed one fails here."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstate.lab.report import docs
from kvstate.lab.report.html import Section, Table

REPO = Path(__file__).resolve().parents[3]
PAGES = sorted((REPO / "docs").glob("*.md"))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_no_page_holds_a_hand_typed_results_table(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    found = [f"{page.name}:{h.line}: {h.text[:80]}" for h in docs.hand_typed(text)]
    assert found == [], "mark it <!-- kvstate:table SECTION \"TITLE\" --> and run `make docs`: " + "; ".join(found)
    assert all((REPO / f).is_file() and f.startswith("docs/results/") for f in docs.quoted_files(text))


def _sections() -> list[Section]:
    t = Table("Scores per method (seed 1001)", ["method", "score"], [["full", 0.93], ["sekv | fast", 0.9]], "n = 100")
    return [Section("semantic", "S", tables=[t])]


def test_a_marked_block_is_replaced_by_the_report_table_and_the_rest_is_kept() -> None:
    page = ("intro\n<!-- kvstate:table semantic \"Scores per method\" -->\nold | 0.5 |\n<!-- /kvstate:table -->\n"
            "after\n")
    out = docs.fill(page, _sections())
    assert out.startswith("intro\n<!-- kvstate:table semantic") and out.endswith("<!-- /kvstate:table -->\nafter\n")
    assert "| full | 0.93 |" in out and "| sekv \\| fast | 0.9 |" in out and "*n = 100*" in out
    assert "old" not in out and docs.fill(out, _sections()) == out  # refreshing again changes nothing
    assert docs.hand_typed(out) == []


def test_a_marker_naming_no_table_or_left_open_is_one_error() -> None:
    with pytest.raises(docs.DocsError, match="no table of section 'semantic'"):
        docs.fill("<!-- kvstate:table semantic \"Nope\" -->\n<!-- /kvstate:table -->\n", _sections())
    with pytest.raises(docs.DocsError, match="no section 'depth'"):
        docs.fill("<!-- kvstate:table depth \"Scores\" -->\n<!-- /kvstate:table -->\n", _sections())
    with pytest.raises(docs.DocsError, match="not closed"):
        docs.fill("<!-- kvstate:table semantic \"Scores\" -->\n| a | 1 |\n", _sections())


def test_hand_typed_numbers_are_found_and_words_or_quoted_pilots_are_not() -> None:
    typed = "text\n\n| method | score |\n|---|---|\n| sekv | 0.93 [0.91, 0.95] |\n"
    assert [h.line for h in docs.hand_typed(typed)] == [5]
    for cell in ("1,024", "2.13x", "+0.3 points", "0.75 / 0.45", "12%", "**0.92**", "[0.1, 0.2]"):
        assert docs.hand_typed(f"| row | {cell} |\n|---|---|\n"), cell
    words = "| method | what |\n|---|---|\n| `optimal` | exact DP, O(NM) with max_rank = 32 |\n"
    assert docs.hand_typed(words) == []
    quoted = "<!-- kvstate:quoted docs/results/pilot.json -->\n| pilot | 0.5 |\n|---|---|\n| a | 0.4 |\n"
    assert docs.hand_typed(quoted) == [] and docs.quoted_files(quoted) == ["docs/results/pilot.json"]
    outside = "<!-- kvstate:quoted models/ref-attn/eval.json -->\n| run | 0.5 |\n|---|---|\n"
    assert docs.hand_typed(outside) != []  # a result under models/ is never quoted by hand


def test_the_marker_syntax_shown_inline_in_running_text_is_neither_a_block_nor_a_quote() -> None:
    page = ('Mark a table with `<!-- kvstate:table SECTION "TITLE" -->` … `<!-- /kvstate:table -->` or quote a pilot '
            "under `<!-- kvstate:quoted docs/results/NAME.json -->`.\n")
    assert docs.fill(page, _sections()) == page and docs.quoted_files(page) == [] and docs.markers(page) == []
