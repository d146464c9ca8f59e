"""The serving part of the position section reads the committed 2nd-visit sweep: one row per arm, and the
headline decided on the default arm's Wilson interval (met, missed or undecided; a missing file names the command)."""

from __future__ import annotations

from kvstate.lab import stats
from kvstate.lab.prefix import replay_section as S
from kvstate.lab.provenance import Recorder, append_run


def _arm(hits: int, n: int) -> dict:
    e = stats.wilson(hits, n)
    t = {"median": 0.3, "spread": [0.2, 0.4], "rounds": [0.3] * 5}
    return {"second_visits": n, "restored_ge_90pct": hits, "share_ge_90pct": hits / n, "share_ci": [e.lo, e.hi],
            "restored_tokens_median": 1024.0 if hits == n else 0.0, "prime_ttft_s": t, "second_visit_ttft_s": t,
            **({"second_visit_ttft_over_off": {"median": 0.1, "spread": [0.08, 0.2], "rounds": [0.1] * 5}}
               if hits == n else {})}


def _commit(models, hits):
    (models / "ref-hybrid").mkdir(exist_ok=True)
    rec = Recorder(code=("prefix",), n=80, seeds=[1100])
    append_run(models / "ref-hybrid" / S.SECOND_FILE, {"benchmark": "prefix_second_visit", "diverge": "end",
                                                       "off": _arm(20, 80), "on-256": _arm(hits, 80)}, rec.finish())


def test_the_default_arm_decides_the_row_and_every_arm_is_a_table_row(models):
    tables, summary = [], {}
    row = S._second_visit(models, tables, summary)
    assert row.status == "missing" and "prefix_second_visit.py" in row.command and not tables
    _commit(models, 80)
    row = S._second_visit(models, tables, summary)
    assert row.status == "met" and row.measured.startswith("1.00 [0.95") and "off 0.25" in row.measured
    assert [r[0] for r in tables[0].rows] == ["off", "on-256"] and tables[0].rows[1][1] == "80 / 80"
    assert tables[0].rows[1][6].startswith("0.10") and tables[0].rows[0][6] == "1"


def test_a_share_below_the_target_is_missed(models):
    _commit(models, 60)
    assert S._second_visit(models, [], {}).status == "missed"
