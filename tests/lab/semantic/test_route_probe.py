"""The routing probe ranks the needle's span under every score and restores SEKV's store afterwards."""

from __future__ import annotations

from kvstate.lab.semantic.route_probe import probe
from kvstate.lab.workloads import build_tokenizer
from kvstate.models.fingerprint import model_fingerprint
from kvstate.models.tiny import tiny_model
from kvstate.semantic import SemanticRouter
from kvstate.semantic.router import RouterConfig
from kvstate.semantic.store import SpanStore


def test_probe_ranks_the_needle_span_and_leaves_the_store_as_it_was(tmp_path):
    tok = build_tokenizer()
    model = tiny_model("qwen3", vocab_size=len(tok))
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    SemanticRouter(RouterConfig.from_model_config(model.config)).save(tmp_path / "r", model_fingerprint(model))
    decide, select = SpanStore.decide, SpanStore.select
    out = probe(str(tmp_path / "m"), str(tmp_path / "r"), length=512, budget=0.5, n=3, seed=0)
    assert SpanStore.decide is decide and SpanStore.select is select
    assert out["layers"] and out["n"] == 3
    for row in out["layers"].values():
        assert 0.0 <= row["anchored"] <= 1.0
        if "rank_bounds" in row:  # the needle fell in a span: each score ranked it among the spans
            assert 0 <= row["rank_shipped_bounds"] < row["n_spans"] and 0 <= row["rank_bounds"] < row["n_spans"]
            assert 0.0 <= row["expanded"] <= 1.0 and row["n_chosen"] <= row["n_spans"]
    assert any("rank_bounds" in row for row in out["layers"].values())  # at least one needle landed in a span
