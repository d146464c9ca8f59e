"""Router training on a frozen tiny model, the generated card, and the report section on a results file."""

import json

import pytest
import torch

from kvstate.errors import KVStateError
from kvstate.lab.semantic.card import write_card
from kvstate.lab.semantic.train import TrainConfig, train_router
from kvstate.lab.workloads import build_tokenizer
from kvstate.models import model_fingerprint, tiny_model
from kvstate.semantic import SemanticRouter
from kvstate.semantic.segment import SegmentConfig


def test_train_router_freezes_base_and_round_trips(tmp_path):
    tok = build_tokenizer()
    model = tiny_model("qwen3", vocab_size=len(tok))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = TrainConfig(max_steps=3, lengths=(96,), segment=SegmentConfig(sinks=2, recent=8, max_span=8), budget=0.4)
    manifest = train_router(model, tok, tmp_path / "r", cfg, progress=False)
    assert manifest["steps"] == 3 and 0 < manifest["trainable_fraction"] < 0.05
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # base frozen
    row = manifest["history"][-1]
    assert all(torch.isfinite(torch.tensor(row[k])) for k in ("loss", "distill", "zoom", "rec"))
    router = SemanticRouter.load(tmp_path / "r", model)
    assert not torch.equal(router.theta, torch.zeros_like(router.theta))  # thresholds moved
    assert json.loads((tmp_path / "r" / "manifest.json").read_text())["fingerprint"] == model_fingerprint(model)
    card = write_card(tmp_path / "r", tmp_path / "base").read_text()
    assert f"{manifest['trainable_parameters']:,}" in card and "| 3 |" in card


def test_train_config_out_of_range():
    with pytest.raises(KVStateError, match="budget"):
        TrainConfig(budget=0.0)
    with pytest.raises(KVStateError, match="lengths"):
        TrainConfig(lengths=(16,))


def test_report_section_reads_results(tmp_path):
    from kvstate.lab.semantic.section import build

    def row(m, b, t, s, fast, ms):
        return {"method": m, "budget": b, "task": t, "length": 1024, "n": 2, "score": s, "fast_bytes": fast,
                "slow_bytes": 0, "decode_ms_per_token": ms, "expanded_fraction": None}

    res = [row("full", 1.0, "niah_single", 1.0, 1000, 10.0), row("sekv", 0.25, "niah_single", 0.9, 250, 14.0),
           row("snap_kv_press", 0.25, "niah_single", 0.5, 250, 9.0)]
    ppl = [{**row("full", 1.0, "ppl", 8.0, 1000, 99.0), "ppl": 8.0, "tokens": 126},
           {**row("sekv", 0.25, "ppl", 10.0, 250, 99.0), "ppl": 10.0, "tokens": 126}]
    cells = [{"method": m, "budget": b, "task": "niah_single", "length": 1024, "index": 0, "question": 0,
              "depth": 0.5, "score": s} for m, b, s in (("full", 1.0, 1.0), ("sekv", 0.25, 1.0),
                                                        ("snap_kv_press", 0.25, 0.0))]
    from kvstate.lab.provenance import Recorder, append_run
    from kvstate.lab.semantic.cli import EVAL_CODE

    (tmp_path / "ref-attn-sekv").mkdir()
    (tmp_path / "ref-hybrid-sekv").mkdir()
    main = {"model": "m", "results": res + ppl, "cells": cells}
    (tmp_path / "ref-attn-sekv" / "eval.json").write_text(json.dumps(main))  # from before provenance: stale
    stale = build(tmp_path, tmp_path)
    assert stale.headline and {h.status for h in stale.headline} == {"stale"}
    (tmp_path / "ref-attn-sekv" / "eval.json").unlink()
    append_run(tmp_path / "ref-attn-sekv" / "eval.json", main, Recorder(code=EVAL_CODE).finish())
    append_run(tmp_path / "ref-hybrid-sekv" / "eval.json", {"model": "h", "results": res[:2] + ppl},
               Recorder(code=EVAL_CODE).finish())
    sec = build(tmp_path, tmp_path)
    ppl_tables = [t for t in sec.tables if "perplexity" in t.title]
    assert len(ppl_tables) == 2 and [r[6] for r in ppl_tables[0].rows] == [1.0, 1.25]  # ppl / full
    hybrid = next(t for t in sec.tables if t.title.startswith("ref-hybrid ("))
    assert [r[:4] for r in hybrid.rows] == [["full", "–", 1.0, 1.0], ["sekv", 0.25, 0.9, 0.9]]
    assert sec.summary["ppl"] == {"full@1.0@1024": 8.0, "sekv@0.25@1024": 10.0}
    assert any("+40.0 points" in h.measured and h.met for h in sec.headline)
    assert any(h.measured == "0.900 / 1.000 = 0.90" and h.met is False for h in sec.headline)
    assert any(h.measured == "1.40x" and h.met for h in sec.headline)
    assert (tmp_path / "semantic_niah.png").is_file() and len(sec.headline) == 5
