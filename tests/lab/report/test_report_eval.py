"""The report's reference-model section: each model's scores written by the experiment loop, read back by the report."""

from __future__ import annotations

from kvstate.lab.report import eval_section
from kvstate.lab.workloads import build_tokenizer
from kvstate.models import tiny_model


def test_eval_section_scores_each_reference_model(tmp_path, monkeypatch):
    tok = build_tokenizer()
    model = tiny_model("qwen3", vocab_size=len(tok))
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    (tmp_path / "no-tokenizer").mkdir()
    model.save_pretrained(tmp_path / "no-tokenizer")
    monkeypatch.setattr(eval_section, "N", 1)
    monkeypatch.setattr(eval_section, "LENGTHS", [256])
    monkeypatch.setattr(eval_section, "GATE_N", 1)
    missing = eval_section.build(tmp_path, tmp_path)  # nothing committed yet: the row names the command
    assert [r.status for r in missing.headline] == ["missing"] and "eval_section --model" in missing.headline[0].measured
    eval_section.measure_reference(tmp_path / "m")  # outside models/: no ledger
    section = eval_section.build(tmp_path, tmp_path)
    rows = section.details[0].rows
    assert [r[0] for r in rows] == ["m"] * len(eval_section.TASKS)
    assert all(0.0 <= r[4] <= 1.0 for r in rows)
    pivot = section.tables[0]
    assert pivot.columns == ["task", "m @ 256"] and [r[0] for r in pivot.rows] == eval_section.TASKS
    assert [r[1] for r in pivot.rows] == [f"{r[4]:.2f}" for r in rows]
    assert (tmp_path / "eval_scores.png").stat().st_size > 1000
    assert set(section.summary["models"]) == {"m"}
    gate = section.summary["gate"]["m"]
    assert gate["n"] == 1 and gate["status"] in ("met", "missed", "undecided")
    if all(gate[t] < 0.9 for t in eval_section.GATE_TASKS):
        assert gate["status"] != "met"
    [row] = section.headline
    assert row.status == gate["status"] and row.source == "artifact" and row.rate and row.ci is not None
    assert row.seeds == (eval_section.SEED,) and row.n == 1 and row.tasks == tuple(eval_section.GATE_TASKS)
    assert row.measured.startswith(f"{gate['niah_single']:.2f} / ")
    assert not (tmp_path / "eval_learning_curves.png").exists()  # no training_state.json: no curve


def test_learning_curve_figure_reads_training_state(tmp_path):
    import json

    (tmp_path / "m").mkdir()
    curve = [{"minutes": t, "length": 64 * 2 ** (t // 4), "exact": {"niah_single": t / 10, "niah_multikey": t / 20}}
             for t in range(10)]
    (tmp_path / "m" / "training_state.json").write_text(json.dumps({"curve": curve}))
    fig = eval_section.curve_figure([tmp_path / "m"], tmp_path)
    assert fig is not None and (tmp_path / fig.filename).stat().st_size > 1000
    assert eval_section.curve_figure([tmp_path / "absent"], tmp_path) is None


def test_eval_section_without_models_says_so(tmp_path):
    section = eval_section.build(tmp_path, tmp_path / "none")
    assert "No reference model" in section.intro and not section.tables
