"""Baselines under the read budget: Quest-like and window byte counts equal their tensors, pages read stay
in budget, a press that could not run is recorded as not run (never 0), a real kvpress press where the
isolated environment exists, and one clear error for a router of another model."""

import json
import sys

import pytest
import torch

from kvstate.lab.semantic.baselines_kvpress import KVPressEnvError, ensure_env, run_presses
from kvstate.lab.semantic.bench import run_method
from kvstate.lab.semantic.methods.quest import PageStore, QuestCache
from kvstate.lab.semantic.methods.window import WindowCache
from kvstate.lab.semantic.protocol import build_items
from kvstate.lab.workloads import build_tokenizer
from kvstate.models import tiny_model
from kvstate.semantic import SegmentConfig, SemanticConfig, semantic_attention

T = 150
SEG = SegmentConfig(sinks=2, recent=8)


def _ids(seed, n):
    return torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _prefill_decode(model, cache, steps=10):
    model(input_ids=_ids(0, T), position_ids=torch.arange(T)[None], cache=cache)
    cache.compress()
    with semantic_attention(model):
        for t, tok in enumerate(_ids(1, steps)[0]):
            model(input_ids=tok.view(1, 1), cache=cache, position_ids=torch.tensor([[T + t]]))


def test_quest_byte_counts_equal_its_tensors_and_pages_read_stay_in_budget(monkeypatch):
    model = tiny_model("qwen3")
    cache = QuestCache(model, config=SemanticConfig(budget=0.45, segment=SEG, zoom="none", slow_tier=False))
    read: dict[int, list[int]] = {}
    attend = PageStore.attend

    def spy(self, query, *a):  # the K/V this pass materialises: anchors + the pages it reads
        before = self.anchor_k.nbytes + self.anchor_v.nbytes
        out = attend(self, query, *a)
        tokens = round(self.expanded[-1] * self.slow_k.shape[1]) if self.expanded else 0
        read.setdefault(id(self), []).append(before + tokens * self.token_bytes)
        return out

    monkeypatch.setattr(PageStore, "attend", spy)
    _prefill_decode(model, cache)
    stores = [layer.store for layer in cache.semantic_layers]
    b = cache.byte_counts()
    assert b.resident_bytes == sum(t.nbytes for s in stores for t in (s.anchor_k, s.anchor_v, s.page_min, s.page_max))
    assert b.total_bytes == b.resident_bytes + sum(s.slow_k.nbytes + s.slow_v.nbytes for s in stores)
    assert b.attended_bytes_peak == max(sum(x) for x in zip(*read.values(), strict=True))
    assert b.full_bytes == len(stores) * (T + 10) * stores[0].token_bytes
    assert max(cache.read_ratios()) <= 0.45 and cache.expanded_fraction() > 0


@pytest.mark.parametrize("sinks", [4, 0])
def test_window_keeps_sinks_and_a_rolling_window_within_budget(sinks):
    model = tiny_model("qwen3")
    cache = WindowCache(model, config=SemanticConfig(budget=0.3, segment=SegmentConfig(sinks=sinks, recent=8),
                                                     zoom="none", slow_tier=False))
    _prefill_decode(model, cache, steps=20)
    st = cache.semantic_layers[0].store
    b = cache.byte_counts()
    kept = sum(layer.store.anchor_k.nbytes + layer.store.anchor_v.nbytes for layer in cache.semantic_layers)
    assert b.resident_bytes == b.total_bytes == kept and st.anchor_k.shape[2] == int(0.3 * (T + 20))
    assert max(cache.read_ratios()) <= 0.3 and b.attended_bytes_peak <= 0.3 * b.full_bytes


def test_streaming_and_window_methods_read_within_budget():
    tok = build_tokenizer()
    model = tiny_model("qwen3", vocab_size=len(tok))
    items = build_items(tok, "niah_single", 160, 2, 0)
    seg = SegmentConfig(sinks=4, recent=8, max_span=8)
    full = run_method("full", model, tok, items, 1.0, None, seg)
    for m in ("streaming", "window"):
        got = run_method(m, model, tok, items, 0.25, None, seg)
        assert all(o.attended_bytes_peak <= 0.25 * o.full_bytes and o.read_ratio_peak <= 0.25 for o in got)
        assert all(o.resident_bytes == o.total_bytes for o in got)
    assert all(o.read_ratio_peak == 1.0 for o in full)


def test_a_kvpress_environment_that_fails_is_one_error_and_every_press_is_not_run(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from kvstate.cli import app

    broken = tmp_path / "venv" / "bin"
    broken.mkdir(parents=True)
    (broken / "python").write_text("#!/bin/sh\necho 'No module named kvpress' >&2\nexit 1\n")
    (broken / "python").chmod(0o755)
    with pytest.raises(KVPressEnvError, match=r"does not import kvpress.*No module named kvpress"):
        ensure_env(tmp_path / "venv", create=False)
    tok = build_tokenizer()
    model = tiny_model("qwen3", vocab_size=len(tok))
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    r = CliRunner().invoke(app, ["semantic", "eval", "--model", str(tmp_path / "m"), "--length", "96", "--n", "1",
                                 "--methods", "full,SnapKVPress,KnormPress", "--budget", "0.25,0.125",
                                 "--kvpress-venv", str(tmp_path / "venv"), "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout[r.stdout.index("{"):])
    assert {row["method"] for row in doc["results"]} == {"full"}  # no press scored 0
    assert sorted((e["method"], e["budget"]) for e in doc["not_run"]) == [
        ("knorm_press", 0.125), ("knorm_press", 0.25), ("snap_kv_press", 0.125), ("snap_kv_press", 0.25)]
    assert all("does not import kvpress" in e["reason"] for e in doc["not_run"])


def test_a_router_for_another_model_is_one_clear_error(tmp_path):
    from typer.testing import CliRunner

    from kvstate.cli import app
    from kvstate.models import model_fingerprint
    from kvstate.semantic import RouterConfig, RouterMismatchError, SemanticRouter

    tok = build_tokenizer()
    model = tiny_model("qwen3", vocab_size=len(tok))
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    other = tiny_model("qwen3", vocab_size=len(tok), seed=1)
    SemanticRouter(RouterConfig.from_model_config(other.config)).save(tmp_path / "r", model_fingerprint(other))
    r = CliRunner().invoke(app, ["semantic", "eval", "--model", str(tmp_path / "m"), "--router", str(tmp_path / "r"),
                                 "--length", "96", "--n", "1", "--methods", "sekv"])
    assert r.exit_code != 0 and isinstance(r.exception, RouterMismatchError)
    assert "trained for a model with fingerprint" in str(r.exception) and "kvstate semantic train" in str(r.exception)


def test_real_kvpress_evicting_presses_report_kept_bytes(model_dir, kvpress_python, tmp_path):
    d, _, tok = model_dir
    items = build_items(tok, "niah_single", 128, 1, 0)
    got, errors = run_presses(kvpress_python, d, items, ["StreamingLLMPress", "KnormPress"], [0.25], tmp_path / "w")
    assert not errors and {o.method for o in got} == {"streaming_llm_press", "knorm_press"}
    assert all(o.resident_bytes == o.total_bytes == o.attended_bytes_peak < 0.4 * o.full_bytes for o in got)
    assert sys.executable != str(kvpress_python)


def test_sentence_segmentation_packs_whole_sentences_into_spans():
    from kvstate.lab.semantic.methods.sentencekv import sentence_segmentation

    tok = build_tokenizer()
    ids = build_items(tok, "niah_single", 400, 1, 0)[0].context
    cfg = SegmentConfig(sinks=4, recent=16, max_span=32)
    seg = sentence_segmentation(tok, ids, cfg)
    period = tok.convert_tokens_to_ids(".")
    covered = sorted([*seg.anchors.tolist(), *(i for a, b in seg.spans for i in range(a, b))])
    assert covered == list(range(len(ids)))  # anchors and spans cover every position once
    assert all(2 <= b - a <= 32 for a, b in seg.spans) and len(seg.spans) < len(ids) // 8
    ends = [b for a, b in seg.spans if b < len(ids) - 16]
    assert sum(ids[b - 1] == period for b in ends) >= 0.8 * len(ends)  # spans end at sentence ends
