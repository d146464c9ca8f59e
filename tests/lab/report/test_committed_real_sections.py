"""The real-model report parts render the result files committed under ``models/`` — a newly landed file whose
rows differ from a test fixture's (a column the runner does not record, say) fails here, in ``make test``, not
first in ``make demo``. These parts read JSON only (no model loads), so this costs seconds."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstate.lab.depth import rcla_section
from kvstate.lab.depth import real_section as depth_real
from kvstate.lab.semantic import real_section as semantic_real
from kvstate.lab.transfer import real_section as transfer_real

MODELS = Path(__file__).resolve().parents[3] / "models"


def _without_figures(build):
    def run(models, _out):
        tables, head = build(models)
        return tables, [], head
    return run


@pytest.mark.parametrize("name, build, committed", [
    ("semantic", semantic_real.build, "smollm2/sekv16_2048_single.json"),
    ("transfer", transfer_real.build, "smollm2/pair_ppl.json"),
    ("depth xkv", _without_figures(depth_real.build), "smollm2/depth_xkv.json"),
    ("depth rcla", _without_figures(rcla_section.build), None),
])
def test_each_real_part_renders_the_committed_files(name, build, committed, tmp_path):
    if committed is not None and not (MODELS / committed).is_file():
        pytest.fail(f"{committed} is committed on main; this test reads it")
    tables, figures, head = build(MODELS, tmp_path)
    assert head  # every part says something about its targets, present or not
    if committed is not None:  # a present file is a table, with every cell rendered to text
        assert tables and all(c is not None and str(c) != "None" for t in tables for r in t.rows for c in r)
    for f in figures:
        assert (tmp_path / f.filename).stat().st_size > 0
