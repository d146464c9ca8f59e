"""The report's reference-model section runs the harness on each model dir that has a tokenizer."""

from __future__ import annotations

from kvstate.models import tiny_model
from kvstate.report import eval_section
from kvstate.workloads import build_tokenizer


def test_eval_section_scores_each_reference_model(tmp_path, monkeypatch):
    tok = build_tokenizer()
    model = tiny_model("qwen3", vocab_size=len(tok))
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    (tmp_path / "no-tokenizer").mkdir()
    model.save_pretrained(tmp_path / "no-tokenizer")
    monkeypatch.setattr(eval_section, "N", 1)
    monkeypatch.setattr(eval_section, "LENGTHS", [256])
    section = eval_section.build(tmp_path, tmp_path)
    assert [r[0] for r in section.tables[0].rows] == ["m"] * len(eval_section.TASKS)
    assert all(0.0 <= r[4] <= 1.0 for r in section.tables[0].rows)
    assert (tmp_path / "eval_m_depth.png").stat().st_size > 1000
    assert set(section.summary["models"]) == {"m"}
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
