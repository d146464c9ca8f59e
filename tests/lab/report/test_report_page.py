"""The report page and its builder: section interface, page shape, summary.json, and a report that is never lost."""

from __future__ import annotations

import json
import math

import pytest

from kvstate.errors import KVStateError, OutputError
from kvstate.lab.make import build as build_mod
from kvstate.lab.make.build import build_report, is_report_dir
from kvstate.lab.report import plots
from kvstate.lab.report.html import (
    COLLAPSE_ROWS,
    SCHEMA_VERSION,
    Figure,
    HeadlineRow,
    Section,
    Table,
    pct,
    pivot,
    render,
    summary_json,
    write_report,
)


def _png(out_dir, name="f.png"):
    fig, axes = plots.figure(0.3, 2)
    axes[0][0].plot([0, 1], [0, 1])
    return plots.save(fig, out_dir, name)


def test_old_style_section_still_renders_figures_before_tables():
    # the fields sections used before conclusion / details / paper existed, positionally
    old = Section("k", "Technique: thing", "how it was measured", [Table("t", ["a"], [[1]])],
                  [Figure("fig", "f.png")], {"x": 1}, [HeadlineRow("thing", "x >= 1", "1", True, source="run")])
    page = render([old])
    assert page.index("<img src='f.png'") < page.index("<caption>t</caption>")
    assert page.index("id='headline-table'") < page.index("<section id='k'>")
    assert "<details>" not in page and "1 met, 0 missed, 0 undecided; 1 measured in this run" in page


def test_long_tables_and_details_are_collapsed_and_conclusion_comes_first():
    long = Table("long", ["i"], [[i] for i in range(COLLAPSE_ROWS + 1)])
    s = Section("k", "T", intro="method", conclusion="we found 3", paper="A Paper", tables=[long],
                details=[Table("full", ["a"], [[1]])])
    page = render([s])
    details = page[page.index("<details>"):page.index("</details>")]
    assert "<caption>long</caption>" in details and "<caption>full</caption>" in details
    assert page.index("we found 3") < page.index("method") < page.index("<details>")
    assert "<cite>A Paper</cite>" in page and "href='#k'" in page


def test_headline_counts_met_missed_undecided():
    rows = [HeadlineRow("a", "t", "1", True, source="run"), HeadlineRow("a", "t", "2", False, source="run"), HeadlineRow("a", "t", "?", None, source="run")]
    page = render([Section("k", "T", headline=rows)])
    assert "1 met, 1 missed, 1 undecided; 3 measured in this run" in page
    assert page.count("class='missed'") == 1 and page.count("class='open'") == 1
    import numpy as np

    assert HeadlineRow("a", "t", "1", np.float64(1.0) <= 2, source="run").met is True  # numpy.bool_ is coerced


def test_headline_rows_say_where_they_came_from_and_rates_carry_intervals():
    from kvstate.lab.provenance import Artifact
    from kvstate.lab.report.html import artifact_row, run_row

    with pytest.raises(KVStateError, match="source"):
        HeadlineRow("a", "t", "1", True)  # neither run nor artifact
    with pytest.raises(KVStateError, match="interval"):
        run_row("a", "t", "0.9", True, rate=True)  # a rate without its interval
    with pytest.raises(KVStateError, match="artifact row"):
        HeadlineRow("a", "t", "1", True, source="artifact")
    assert run_row("a", "t", "0.95", status="met", ci=(0.91, 0.98), rate=True).met is True
    stale = Artifact("models/x/r.json", "kvstate x --out models/x/r.json", "stale", "no provenance recorded",
                     {"v": 1}, 1)
    row = artifact_row(stale, "a", "v >= 1", "1", True)
    assert row.status == "stale" and row.met is None and "regenerate with `kvstate x" in row.measured
    page = render([Section("k", "T", headline=[row])])
    assert "0 met, 0 missed, 0 undecided; 0 measured in this run (1 stale" in page
    missing = Artifact("models/x/r.json", "kvstate x", "missing", "file not found", None, 0)
    assert artifact_row(missing, "a", "t", "").status == "missing"


def test_duplicate_keys_and_bad_figure_names_are_refused(tmp_path):
    with pytest.raises(KVStateError, match="share a key"):
        render([Section("k", "A"), Section("k", "B")])
    with pytest.raises(KVStateError, match="bare file name"):
        render([Section("k", "A", figures=[Figure("f", "../x.png")])])
    with pytest.raises(KVStateError, match="was not written"):
        write_report(tmp_path, [Section("k", "A", figures=[Figure("f", "absent.png")])])


def test_summary_json_has_schema_headline_and_strict_numbers(tmp_path):
    import numpy as np

    s = Section("k", "T", summary={"nan": math.nan, "np": np.float64(0.25), "arr": np.arange(3)},
                headline=[HeadlineRow("t", "x", "0.25", True, source="run")])
    s.seconds = 1.5
    write_report(tmp_path, [s], {"torch_threads": 1})
    data = json.loads((tmp_path / "summary.json").read_text())  # strict JSON: NaN became null
    assert data["schema_version"] == SCHEMA_VERSION and data["generator"] == "kvstate report"
    assert data["sections"]["k"] == {"nan": None, "np": 0.25, "arr": [0, 1, 2]}
    assert data["headline"] == [{"section": "k", "technique": "t", "target": "x", "measured": "0.25", "met": True,
                                 "source": "run", "status": "met", "ci": None, "rate": False, "artifact": None,
                                 "commit": None, "command": None, "seeds": None, "n": None, "tasks": None,
                                 "excluded_tasks": None, "timing": False, "kind": "result", "because": "",
                                 "recorded": ""}]
    assert data["headline_counts"] == {"met": 1, "missed": 0, "undecided": 0, "stale": 0, "missing": 0, "live": 1,
                                       "checks": 0, "checks_failing": 0}
    assert data["checks"] == [] and data["verdicts"] == []  # no section named its axis
    assert data["run"]["sections"] == [{"key": "k", "title": "T", "paper": "", "seconds": 1.5}]
    assert oct((tmp_path / "summary.json").stat().st_mode & 0o777) == "0o644"
    assert summary_json([s])["sections"]["k"]["nan"] is s.summary["nan"]  # the section's dict is not modified
    with pytest.raises(KVStateError, match="not JSON-serialisable"):
        write_report(tmp_path, [Section("k", "T", summary={"x": object()})])


def test_pivot_and_pct():
    records = [{"M": m, "method": k, "v": m / 10 + (k == "b") / 100} for m in (1, 2) for k in ("a", "b")]
    t = pivot(records, "M", "method", "v", "title", fmt=pct)
    assert t.columns == ["M", "a", "b"]
    assert t.rows == [[1, "10.0%", "11.0%"], [2, "20.0%", "21.0%"]]
    assert pivot(records[:3], "M", "method", "v").rows[1] == [2, "0.2", "—"]
    assert pct(None) == "—" and pct(math.nan) == "—" and pct(0.12345, 2) == "12.35%"


def test_palette_is_fixed_for_known_and_stable_for_new_names():
    assert plots.color("optimal") == plots.PALETTE["optimal"]
    assert plots.color("some new method") == "#bcbd22" in plots._BASE  # crc32, not hash(): the same in every run
    assert plots.color("optimal") != plots.color("block")


def test_heatmap_annotates_cells_and_declines_a_flat_grid(tmp_path):
    fig, axes = plots.figure(0.4, 2)
    ax = axes[0][0]
    assert not plots.heatmap(ax, [[1.0, 1.0], [1.0, None]], ["a", "b"], ["x", "y"], "len (tokens)", "depth")
    assert not ax.images  # nothing drawn
    assert plots.heatmap(ax, [[0.95, 1.0], [0.5, None]], ["a", "b"], ["x", "y"], "len (tokens)", "depth")
    assert sorted(t.get_text() for t in ax.texts) == ["0.50", "0.95", "1.00"]
    lo, hi = ax.images[0].get_clim()
    assert (lo, hi) == (0.5, 1.0)  # the scale spans the values present
    plots.save(fig, tmp_path, "h.png")


# --- the report directory is replaced whole or not at all --------------------------------------------------


def _fast(out_dir, models_dir):
    return Section("fast", "Fast", figures=[Figure("f", _png(out_dir, "fast.png"))], summary={"v": 1},
                   headline=[HeadlineRow("fast", "v = 1", "1", True, source="run")])


def _other(out_dir, models_dir):
    return Section("other", "Other", figures=[Figure("g", _png(out_dir, "other.png"))])


def _failing(out_dir, models_dir):
    _png(out_dir, "half.png")
    raise RuntimeError("section failed midway")


def _snapshot(d):
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_failed_run_leaves_the_previous_report_whole(tmp_path, monkeypatch):
    out = tmp_path / "report"
    monkeypatch.setattr(build_mod, "SECTIONS", [("fast", _fast), ("fail", _failing)])
    build_report(out, tmp_path, only=["fast"])
    before = _snapshot(out)
    assert set(before) == {"index.html", "summary.json", "fast.png"}
    with pytest.raises(RuntimeError, match="midway"):
        build_report(out, tmp_path)
    assert _snapshot(out) == before  # no fresh plot beside the old page, nothing rewritten
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report"]  # no staging directory left behind


def test_a_new_report_replaces_the_old_one_entirely(tmp_path, monkeypatch):
    out = tmp_path / "report"
    monkeypatch.setattr(build_mod, "SECTIONS", [("fast", _fast), ("other", _other)])
    build_report(out, tmp_path)
    build_report(out, tmp_path, only=["other"])
    assert set(_snapshot(out)) == {"index.html", "summary.json", "other.png"}  # fast.png went with the old report
    assert json.loads((out / "summary.json").read_text())["run"]["wall_seconds"] >= 0
    assert oct(out.stat().st_mode & 0o777) == "0o755"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report"]


def test_output_that_is_not_a_report_is_refused_before_any_work(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(build_mod, "SECTIONS", [("fast", lambda o, m: calls.append(o) or _fast(o, m))])
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "thesis.txt").write_text("keep me")
    with pytest.raises(OutputError, match=r"is not a kvstate report.*holds thesis\.txt; choose a new or empty"):
        build_report(notes, tmp_path)
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputError, match="is an existing file"):
        build_report(tmp_path / "file", tmp_path)
    with pytest.raises(KVStateError, match="no such report section"):
        build_report(tmp_path / "new", tmp_path, only=["nope"])
    assert not calls and (notes / "thesis.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "notes"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert is_report_dir(empty)
    build_report(empty, tmp_path)
    assert is_report_dir(empty) and not is_report_dir(notes)


def test_unwritable_parent_is_reported_before_any_work(tmp_path, monkeypatch):
    from pathlib import Path

    calls = []
    monkeypatch.setattr(build_mod, "SECTIONS", [("fast", lambda o, m: calls.append(o) or _fast(o, m))])
    with pytest.raises(OutputError, match="cannot be written"):
        build_report(Path("/proc/kvstate-report"), tmp_path)  # not writable, even for root
    assert not calls


def test_checks_are_shown_apart_and_never_counted_as_met(tmp_path):
    from kvstate.lab.report.html import check_row, run_row

    rows = [run_row("r", "quality >= 0.9", "0.95", status="met", ci=(0.91, 0.98), rate=True, seeds=(1000,), n=100,
                    tasks=("a", "b"), excluded_tasks={"c": 0.4}),
            check_row("r", "reads <= budget", True, "the reader caps reads at the budget"),
            check_row("r", "total <= 0.5x", False, "follows from the constants")]
    with pytest.raises(KVStateError, match="says what it holds by"):
        check_row("r", "x", True, "")
    s = Section("k", "T", headline=rows, axis="resolution")
    page = render([s])
    head = page[page.index("id='headline-table'"):page.index("id='checks-table'")]
    checks = page[page.index("id='checks-table'"):]
    assert "reads &lt;= budget" not in head and "reads &lt;= budget" in checks and "caps reads" in checks
    assert "1 met, 0 missed, 0 undecided; 1 measured in this run" in page
    write_report(tmp_path, [s])
    data = json.loads((tmp_path / "summary.json").read_text())
    assert [r["target"] for r in data["headline"]] == ["quality >= 0.9"]
    assert [(r["target"], r["status"]) for r in data["checks"]] == [("reads <= budget", "met"),
                                                                     ("total <= 0.5x", "missed")]
    assert data["headline_counts"]["met"] == 1 and data["headline_counts"]["checks_failing"] == 1
    row = data["headline"][0]
    assert (row["seeds"], row["n"], row["tasks"], row["excluded_tasks"]) == ([1000], 100, ["a", "b"], {"c": 0.4})


def test_a_verdict_per_axis_at_the_top_with_its_best_number():
    from kvstate.lab.report.html import run_row, verdicts

    met = run_row("p", "speed-up >= 1.5x", "2.1x", status="met", ci=(1.8, 2.4))
    miss = run_row("p", "hit <= 5 ms", "9 ms", status="missed", ci=(8.0, 10.0))
    und = run_row("d", "drop <= 2 pp", "1 pp", status="undecided", ci=(-1.0, 3.0))
    sections = [Section("a", "A", headline=[met, miss], axis="position"), Section("b", "B", headline=[und], axis="depth"),
                Section("c", "C", headline=[met], axis="resolution")]
    v = {x["axis"]: x for x in verdicts(sections)}
    assert (v["position"]["verdict"], v["position"]["best"]["measured"]) == ("partly", "2.1x")
    assert (v["depth"]["verdict"], v["depth"]["best"]["ci"]) == ("not yet", (-1.0, 3.0))
    assert v["resolution"]["verdict"] == "works" and v["position"]["met"] == 1 and v["position"]["targets"] == 2
    page = render(sections)
    assert page.index("id='verdicts'") < page.index("id='headline-table'")
    assert "partly</span> (1 of 2 targets met) — speed-up &gt;= 1.5x: 2.1x [1.8, 2.4] (met)" in page


def test_a_timing_row_needs_five_repeats_and_its_spread():
    from kvstate.lab.report.html import run_row

    with pytest.raises(KVStateError, match="timing row needs >= 5 interleaved repeats"):
        run_row("p", "t", "1.2x", status="met", ci=(1.1, 1.3), timing=True, repeats=3)
    with pytest.raises(KVStateError, match="timing row needs"):
        run_row("p", "t", "1.2x", True, timing=True, repeats=5)  # no spread
    assert run_row("p", "t", "1.2x", status="met", ci=(1.1, 1.3), timing=True, repeats=5).repeats == 5


def test_an_artifact_row_takes_seeds_n_and_tasks_from_the_files_provenance():
    from kvstate.lab.provenance import Artifact
    from kvstate.lab.report.html import artifact_row

    run = {"provenance": {"seeds": [1001], "n": 64, "tasks": ["chat"], "settings": {"repeats": 7}}}
    art = Artifact("models/x/r.json", "kvstate x", "current", "", run, 1)
    row = artifact_row(art, "p", "t", "1.2x", status="met", ci=(1.1, 1.3), timing=True)
    assert (row.seeds, row.n, row.tasks, row.repeats) == ((1001,), 64, ("chat",), 7)
    assert artifact_row(art, "p", "t", "1", True, seeds=(1002,)).seeds == (1002,)  # what the section passes wins


def test_a_stale_files_recorded_decision_counts_toward_the_verdict_and_is_said_to_be_stale():
    from kvstate.lab.provenance import Artifact
    from kvstate.lab.report.html import artifact_row, verdicts

    stale = Artifact("models/x/r.json", "kvstate x", "stale", "src changed", {"provenance": {"seeds": [1000]}}, 1)
    row = artifact_row(stale, "d", "drop <= 2 pp", "1.0 pp", status="met", ci=(0.5, 1.5))
    assert row.status == "stale" and row.recorded == "met" and row.seeds == (1000,)
    missing = artifact_row(Artifact("models/x/q.json", "kvstate q", "missing", "file not found", None, 0), "d", "t", "")
    (v,) = verdicts([Section("a", "A", headline=[row, missing], axis="depth")])
    assert (v["verdict"], v["met"], v["targets"], v["from_stale_files"], v["stale_or_missing"]) == ("partly", 1, 2, 1, 1)
    assert v["best"]["measured"] == "1.0 pp" and v["best"]["status"] == "met"
    page = render([Section("a", "A", headline=[row, missing], axis="depth")])
    assert "1 without a decision (stale or missing), 1 read from stale files" in page


def test_the_verdict_line_names_the_axis_claim_first_then_the_best_and_the_worst_row():
    from kvstate.lab.report.html import run_row, verdicts

    easy = run_row("d", "perplexity <= 1.03x", "1.02x", status="met", ci=(1.01, 1.03))
    claim = run_row("d", "worst pattern >= 0.9x the unmodified model at 2048", "0.55x", status="missed",
                    ci=(0.45, 0.65))
    other = run_row("d", "decode tokens/s >= keep 1's", "0.98x", status="undecided", ci=(0.9, 1.05))
    s = Section("depth", "D", headline=[easy, claim, other], axis="depth", claim=("worst pattern >= 0.9x",))
    (v,) = verdicts([s])
    assert [c["target"] for c in v["claim"]] == [claim.target] and v["claim"][0]["status"] == "missed"
    assert v["best"]["target"] == easy.target and v["worst"]["target"] == claim.target
    page = render([s])
    line = page[page.index("id='verdicts'"):page.index("</ul>")]
    assert line.index("claim: worst pattern") < line.index("best: perplexity") < line.index("worst: worst pattern")
    (none,) = verdicts([Section("depth", "D", headline=[easy], axis="depth", claim=("not a target here",))])
    assert none["claim"] is None
    assert "claim: no row states it yet" in render([Section("depth", "D", headline=[easy], axis="depth",
                                                            claim=("not a target here",))])
    at_4k = run_row("d", "worst pattern >= 0.9x the unmodified model at 4096", "0.95x", status="met", ci=(0.9, 1.0))
    page = render([Section("depth", "D", headline=[easy, at_4k, claim], axis="depth", claim=("worst pattern",))])
    assert "claim: 2 rows (1 missed, 1 met), the worst worst pattern &gt;= 0.9x the unmodified model at 2048" in page


def test_every_axis_claim_names_a_target_the_lab_writes():
    """A claim is matched by target text: renaming the target without the claim would silently drop it."""
    from pathlib import Path

    from kvstate.lab.make.build import AXIS_OF, CLAIMS

    src = "\n".join(p.read_text() for p in (Path(__file__).resolve().parents[3] / "src" / "kvstate" / "lab").rglob(
        "*.py") if p.name != "build.py")
    assert set(CLAIMS) == set(AXIS_OF.values())
    for axis, needles in CLAIMS.items():
        # a "[pair] " tag is put before a section's target text where it is built
        assert needles and all(n.split("] ", 1)[-1] in src for n in needles), axis
