"""The stall benchmark's report part reads the committed run: the default arm's decisions as headline rows, the
later-visit and goodput shares beside them, every arm in the table; a missing file names its command."""

from __future__ import annotations

import json
from pathlib import Path

from kvstate.lab.serving import peer_section, section


def _doc(tmp: Path) -> Path:
    dec = [{"label": "chunk512, shared-prefix: ITL p50 at c = 8 <= 2.5x c = 1's", "method": "chunk512@c8",
            "metric": "ratio", "value": 2.1, "ci": [2.0, 2.2], "status": "met", "seeds": [1072], "repeats": 5},
           {"label": "chunk512, shared-prefix: output tokens/s at c = 8 >= 3x c = 1", "method": "chunk512@c8",
            "metric": "ratio", "value": 0.4, "ci": [0.25, 0.5], "status": "missed", "seeds": [1072], "repeats": 5},
           {"label": "stall64, shared-prefix: ITL p50", "method": "stall64@c8", "metric": "ratio", "value": 2.0,
            "ci": [1.9, 2.1], "status": "met", "seeds": [1072], "repeats": 5}]
    reps = {f"r{i}": {"itl_p50_s": 0.01, "ttft_p50_s": 0.1, "ttft_p99_s": 0.2 + i, "output_tok_s": 100.0,
                      "goodput": 1.0} for i in range(5)}
    run = {"provenance": {"seeds": [1072], "settings": {"repeats": 5}, "command": "cmd"},
           "rows": [{"task": "shared-prefix", "method": m, "extra": reps} for m in ("chunk512@c8", "stall64@c8")],
           "decisions": dec,
           "later_visits": [{"method": "chunk512@c8", "restoring_90pct": 100, "visits": 100, "share": 1.0,
                             "ci": [0.963, 1.0], "status": "met"}],
           "goodput": [{"method": "chunk512@c8", "task": "shared-prefix", "met": 30, "requests": 40, "share": 0.75,
                        "ci": [0.6, 0.86]}, {"method": "stall64@c8", "task": "shared-prefix", "met": 1, "requests": 40,
                                              "share": 0.025, "ci": [0.0, 0.1]}]}
    (tmp / "ref-hybrid").mkdir()
    (tmp / section.FILE).write_text(json.dumps({"format": "kvstate-results/1", "runs": [run]}))
    return tmp


def test_the_default_arms_decisions_lead_and_every_arm_is_in_the_table(tmp_path: Path) -> None:
    tables, head = section._stall(_doc(tmp_path))
    assert [r.target.split(":")[0] for r in head[:2]] == ["chunk512, shared-prefix"] * 2
    assert all("stall64" not in r.target for r in head)
    assert head[1].measured.startswith("2.50x tokens/s [2.00, 4.00]") and head[1].recorded in ("", "missed")
    assert "100 / 100" in head[2].measured and "goodput at c = 8" in head[3].target
    assert head[3].status in ("missed", "stale") and len(head) == 4
    assert [r[1] for r in tables[0].rows] == ["chunk512@c8", "stall64@c8"] and tables[0].rows[0][4] == "2200"


def test_a_missing_run_names_the_command(tmp_path: Path) -> None:
    tables, (row,) = section._stall(tmp_path)
    assert tables == [] and row.status == "missing" and "kvstate.lab.serving.stall" in (row.command or "")


def test_the_45238_part_shows_the_decisions_as_hits_of_64_and_a_missing_file_names_its_command(tmp_path: Path) -> None:
    run = {"provenance": {"seeds": [1077], "command": "cmd"},
           "rows": [{"task": "1500-700", "method": m, "values": [0.0] + [1.0] * 63,
                     "extra": {"restored": [0] + [1472] * 63, "ttft_s": [0.4] + [0.1] * 63}}
                    for m in ("grid-off", "server")],
           "decisions": [{"label": "vLLM #45238 shape 1500-700: >= 60 / 64", "method": "server", "metric": "score",
                          "value": 63 / 64, "ci": [0.92, 0.997], "status": "undecided", "seeds": [1077], "n": 64}]}
    (tmp_path / "ref-hybrid").mkdir()
    (tmp_path / section.SHAPE_FILE).write_text(json.dumps({"format": "kvstate-results/1", "runs": [run]}))
    tables, (row,) = section._shape(tmp_path)
    assert row.measured.startswith("63.0 / 64 [58.9, 63.8]")
    assert tables[0].rows[1] == ["1500-700", "server", "63 / 64", "1472", "100"]
    tables, head = section.build(tmp_path)  # the stall file is missing there: its row says so, with its command
    assert head[0].status == "missing" and "serving.stall" in (head[0].command or "")
    assert len(head) == 2 + len(peer_section.RUNS) and all(r.status == "missing" for r in head[2:])
