"""The compress-then-ask benchmark: task-file round trip through the kvpress runner, baselines, CLI errors."""

import sys
import textwrap
from pathlib import Path

import pytest

from kvstate.errors import KVStateError
from kvstate.lab.semantic.baselines_kvpress import run_presses, snake
from kvstate.lab.semantic.bench import ROW_FIELDS, run_method, summarise
from kvstate.lab.semantic.protocol import (
    MULTI_Q,
    build_items,
    items_to_rows,
    read_jsonl,
    rows_to_items,
    write_jsonl,
)
from kvstate.lab.workloads import build_tokenizer
from kvstate.models import tiny_model
from kvstate.semantic.segment import SegmentConfig
from tests.semantic_util import lowrank_config

FAKE_KVPRESS = textwrap.dedent('''
    """A stand-in for kvpress: a press that keeps everything (so the runner must equal the full cache), and an
    evicting one written as kvpress's StreamingLLMPress is (4 sinks + the most recent tokens, after prefill)."""
    import contextlib

    class KeepAllPress:
        def __init__(self, compression_ratio=0.0):
            self.compression_ratio = compression_ratio

        def __call__(self, model):
            return contextlib.nullcontext()

    class EvictPress(KeepAllPress):
        n_sink = 4

        @contextlib.contextmanager
        def __call__(self, model):
            import torch

            def hook(module, args, kwargs, output):
                cache = kwargs.get("past_key_values") or kwargs.get("cache")
                for layer in cache.layers:
                    t = layer.keys.shape[2]
                    kept = t - int(t * self.compression_ratio)
                    idx = torch.cat([torch.arange(self.n_sink), torch.arange(t - kept + self.n_sink, t)])
                    layer.keys, layer.values = layer.keys[:, :, idx], layer.values[:, :, idx]

            handle = model.register_forward_hook(hook, with_kwargs=True)
            try:
                yield
            finally:
                handle.remove()

    class BrokenPress(KeepAllPress):
        def __call__(self, model):
            raise RuntimeError("needs a GPU kernel")
''')


def _fake_kvpress(tmp_path, monkeypatch):
    (tmp_path / "fake" / "kvpress").mkdir(parents=True)
    (tmp_path / "fake" / "kvpress" / "__init__.py").write_text(FAKE_KVPRESS)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "fake"))


def test_task_file_round_trip(tmp_path, model_dir):
    _, _, tok = model_dir
    items = build_items(tok, "niah_single", 128, 2, 0) + build_items(tok, MULTI_Q, 160, 1, 0)
    assert len(items[-1].questions) == 4 and items[-1].answers[0] != items[-1].answers[1]
    write_jsonl(tmp_path / "t.jsonl", items_to_rows(items))
    assert rows_to_items(read_jsonl(tmp_path / "t.jsonl")) == items


def test_runner_with_keep_all_press_equals_full_cache(tmp_path, model_dir, monkeypatch):
    d, model, tok = model_dir
    _fake_kvpress(tmp_path, monkeypatch)
    items = build_items(tok, "niah_single", 96, 1, 0) + build_items(tok, MULTI_Q, 128, 1, 0)
    got, errors = run_presses(Path(sys.executable), d, items,
                              ["KeepAllPress", "MissingPress", "BrokenPress"], [0.5], tmp_path / "work")
    ref = run_method("full", model, tok, items, 1.0, None, SegmentConfig())
    assert [o.prediction for o in got] == [o.prediction for o in ref]
    for f in ("resident_bytes", "total_bytes", "attended_bytes_peak", "full_bytes"):
        assert [getattr(o, f) for o in got] == [getattr(o, f) for o in ref]
    assert {o.method for o in got} == {"keep_all_press"} and {o.budget for o in got} == {0.5}
    why = {e["method"]: e["reason"] for e in errors}
    assert "MissingPress" in why["missing_press"] and "needs a GPU kernel" in why["broken_press"]


def test_runner_with_an_evicting_press_reports_the_kept_bytes(tmp_path, model_dir, monkeypatch):
    d, model, tok = model_dir
    _fake_kvpress(tmp_path, monkeypatch)
    items = build_items(tok, "niah_single", 128, 2, 0)
    got, errors = run_presses(Path(sys.executable), d, items, ["EvictPress"], [0.25], tmp_path / "work")
    full = run_method("full", model, tok, items, 1.0, None, SegmentConfig())
    assert not errors and len(got) == 2
    layers, kv, dim = model.config.num_hidden_layers, model.config.num_key_value_heads, model.config.head_dim
    token = layers * 2 * kv * dim * 4  # float32
    for o, it in zip(got, items, strict=True):
        t, q = len(it.context), len(it.questions[0])
        kept = t - int(t * 0.75)
        seen = t + q + o.decode_steps
        assert o.resident_bytes == o.total_bytes == o.attended_bytes_peak == (kept + q + o.decode_steps) * token
        assert o.full_bytes == seen * token and o.resident_bytes < 0.4 * o.full_bytes
    assert [o.prediction for o in got] != [o.prediction for o in full] or all(o.score == 1 for o in full)


def test_in_process_methods_and_summary(model_dir):
    _, model, tok = model_dir
    items = build_items(tok, "niah_single", 160, 1, 0)
    seg = SegmentConfig(sinks=2, recent=8, max_span=8)
    rows = summarise(run_method("sekv", model, tok, items, 0.7, None, seg, expand_share=0.3, slow_budget=0.6)
                     + run_method("sentencekv", model, tok, items, 0.7, None, seg, expand_share=0.3))
    by = {r["method"]: r for r in rows}
    assert set(by["sekv"]) == set(ROW_FIELDS) and by["sekv"]["n"] == 1
    lo, hi = by["sekv"]["score_ci"]
    assert 0 <= lo <= by["sekv"]["score"] <= hi <= 1
    for m in ("sekv", "sentencekv"):
        r = by[m]
        assert r["total_bytes"] > r["resident_bytes"] and r["attended_bytes_peak"] <= 0.7 * r["full_bytes"]
    with pytest.raises(ValueError, match="unknown in-process method"):
        run_method("h2o", model, tok, items, 0.4, None, seg)


def _written_out(method, model, tok, items, budget, seg):
    """The protocol written out: each method prefills its own cache, compresses it and answers every question
    on a deep copy of it (ppl: continues on the cache itself)."""
    import copy

    import numpy as np
    import torch
    from transformers import DynamicCache

    from kvstate.lab.perplexity import continuation_nll, pooled_perplexity
    from kvstate.lab.semantic import methods
    from kvstate.lab.semantic.bench import _answer, _outcome, score_prediction
    from kvstate.lab.semantic.methods.sentencekv import sentence_segmentation
    from kvstate.lab.semantic.protocol import PPL
    from kvstate.semantic import semantic_attention, surprisal

    out = []
    for it in items:
        ctx = torch.tensor([it.context])
        tc = ctx.shape[1]
        with torch.no_grad():
            if method == "full":
                cache = DynamicCache(config=model.config)
            else:
                cfg = methods.get(method).config(budget, methods.Context(None, seg, 0.3, 0.6))
                cache = methods.get(method).cache_class(model, None, cfg)  # the registry names each one's cache
                if method.startswith(("sekv_zip", "kvzip")):  # the library's retention at the method's bits
                    from kvstate.semantic.retention import RetainedCache

                    cache = RetainedCache(model, methods.get(method).retention(budget, methods.Context(None, seg)))
            logits = model(input_ids=ctx, position_ids=torch.arange(tc)[None], cache=cache).logits
            if method.startswith(("sekv_zip", "kvzip")):  # scored on its own full-resolution prefill
                from kvstate.semantic.retention import reconstruction_scores

                cache.compress(reconstruction_scores(model, tok, cache, it.context))
            elif method.startswith("sekv") and not method.startswith("sekv_pages"):
                cache.compress(surprisal(logits, ctx))
            elif method == "sentencekv":
                sg = sentence_segmentation(tok, it.context, cfg.segment)
                cache.compress_segmentation(sg, [np.full(b - a, 1.0 / (b - a)) for a, b in sg.spans])
            elif method != "full":
                cache.compress()
            attn = semantic_attention(model) if method != "full" else torch.no_grad()
            with attn, torch.no_grad():
                if it.task == PPL:
                    got = continuation_nll(model, it.context + it.questions[0], tc, cache, stepwise=True)
                    out.append(_outcome(method, budget, it, 0, pooled_perplexity([got]), "", cache, got.seconds,
                                        got.tokens, got.nll, got.tokens))
                    continue
                for qi, (q, mx) in enumerate(zip(it.questions, it.max_new_tokens, strict=True)):
                    work = copy.deepcopy(cache, memo={id(model.config): model.config}) if method != "full" \
                        else copy.deepcopy(cache)
                    pred, dt, steps = _answer(model, work, q, tc, mx, tok.eos_token_id, tok)
                    out.append(_outcome(method, budget, it, qi, score_prediction(it, qi, pred), pred, work, dt, steps))
    return out


def test_shared_prefill_and_forks_equal_the_protocol_written_out(model_dir):
    """One prefill per item, forks per question and one compression for sekv / sekv_fresh change no result."""
    import dataclasses

    from kvstate.lab.semantic.bench import run_methods
    from kvstate.lab.semantic.methods import METHODS
    from kvstate.lab.semantic.protocol import PPL

    _, model, tok = model_dir
    items = build_items(tok, MULTI_Q, 128, 1, 0)
    items += [dataclasses.replace(it, questions=[it.questions[0][:8]]) for it in build_items(tok, PPL, 96, 1, 0)]
    seg = SegmentConfig(sinks=2, recent=8, max_span=8)
    in_process = tuple(METHODS)
    runs = [("full", 1.0)] + [(m, b) for m in in_process if m != "full" for b in (0.7, 0.02)]
    got, not_run = run_methods(runs, model, tok, items, None, seg, expand_share=0.3, slow_budget=0.6)
    failed = {(e["method"], e["budget"]) for e in not_run}  # below the minimum; the window alone keeps 3 tokens
    assert failed == {(m, 0.02) for m in in_process if m not in ("full", "window")}
    assert all("budget" in e["reason"] for e in not_run)
    ref = [o for m, b in runs if (m, b) not in failed for o in _written_out(m, model, tok, items, b, seg)]
    drop = ("decode_s",)  # wall time
    rows = [{k: v for k, v in dataclasses.asdict(o).items() if k not in drop} for o in got]
    assert rows == [{k: v for k, v in dataclasses.asdict(o).items() if k not in drop} for o in ref]
    assert {o.method for o in got} == set(in_process) and any(o.expanded for o in got if o.method == "sekv")


def test_snake_names():
    assert [snake(n) for n in ("SnapKVPress", "StreamingLLMPress", "TOVAPress", "ExpectedAttentionPress")] == [
        "snap_kv_press", "streaming_llm_press", "tova_press", "expected_attention_press"]


def test_cli_rejects_bad_inputs(tmp_path):
    from typer.testing import CliRunner

    from kvstate.cli import app

    r = CliRunner().invoke(app, ["semantic", "eval", "--model", "models/ref-attn", "--task", "nope"])
    assert r.exit_code != 0 and isinstance(r.exception, KVStateError) and "--task 'nope' is unknown" in str(r.exception)
    r = CliRunner().invoke(app, ["semantic", "eval", "--model", "models/ref-attn", "--budget", "1.5"])
    assert isinstance(r.exception, KVStateError) and "--budget" in str(r.exception)


@pytest.mark.parametrize("family", ["qwen3", pytest.param("qwen3_5", marks=pytest.mark.slow)])
def test_ppl_every_span_expanded_at_full_rank_equals_full_kv(family):
    import dataclasses
    import math

    import torch

    from kvstate.lab.semantic.protocol import CONTINUATION, PPL

    tok = build_tokenizer()
    model = tiny_model(family, vocab_size=len(tok))
    items = build_items(tok, PPL, 128, 2, 0)
    assert all(len(it.context) == 128 and 24 <= len(it.questions[0]) <= CONTINUATION for it in items)
    assert items[0].context != items[1].context
    items = [dataclasses.replace(it, questions=[it.questions[0][:20]]) for it in items]  # keep the test short
    seg = SegmentConfig(sinks=2, recent=8, min_span=2, max_span=12)
    full = run_method("full", model, tok, items, 1.0, None, seg)
    exact = run_method("sekv", model, tok, items, 0.4, None, seg,
                       config=lowrank_config(budget=0.4, zoom="all", rank=64, segment=seg))
    lossy = run_method("sekv", model, tok, items, 0.4, None, seg,
                       config=lowrank_config(budget=0.4, zoom="none", segment=seg))
    with torch.no_grad():  # brute force: one full forward over context + continuation
        nll = 0.0
        for it in items:
            ids = torch.tensor([it.context + it.questions[0]])
            logits = model(input_ids=ids).logits[0, len(it.context):-1].float()
            nll += float(torch.nn.functional.cross_entropy(logits, ids[0, len(it.context) + 1:], reduction="sum"))
    count = sum(len(it.questions[0]) - 1 for it in items)
    rows = {r["method"] + str(i): r for i, rs in enumerate((full, exact, lossy)) for r in summarise(rs)}
    ref = math.exp(nll / count)
    assert sum(o.tokens for o in full) == count and rows["full0"]["task"] == "ppl"
    assert abs(rows["full0"]["score"] - ref) < 1e-4 * ref
    assert rows["full0"]["score_ci"][0] <= rows["full0"]["score"] <= rows["full0"]["score_ci"][1]
    assert all(abs(a.nll - b.nll) < 1e-4 for a, b in zip(full, exact, strict=True))
    assert abs(rows["sekv1"]["score"] - rows["full0"]["score"]) < 1e-4 * ref
    assert rows["sekv1"]["total_bytes"] > rows["sekv1"]["resident_bytes"]
    assert abs(rows["sekv2"]["score"] - ref) > 1e-3 * ref  # the oracle can fail


def test_cli_ppl_rows(tmp_path, model_dir):
    import json

    from typer.testing import CliRunner

    from kvstate.cli import app

    d, _, _ = model_dir
    out = tmp_path / "eval.json"
    r = CliRunner().invoke(app, ["semantic", "eval", "--model", str(d), "--task", "ppl", "--length", "96", "--n", "1",
                                 "--methods", "full,sekv", "--budget", "0.8", "--recent", "8", "--max-span", "8", "--slow-budget", "0.6",
                                 "--save", str(out)])
    assert r.exit_code == 0, r.output
    [run] = json.loads(out.read_text())["runs"]  # one run, with where it came from
    assert run["provenance"]["n"] == 1 and run["provenance"]["lengths"] == [96]
    assert run["provenance"]["parts"] == 1 and not (tmp_path / ".eval.json.journal").exists()  # removed when written
    rows = {x["method"]: x for x in run["results"]}
    assert set(rows) == {"full", "sekv"} and all(x["task"] == "ppl" and list(x) == list(ROW_FIELDS)
                                                 for x in rows.values())
    assert rows["full"]["score"] > 1 and rows["sekv"]["attended_bytes_peak"] <= 0.8 * rows["sekv"]["full_bytes"]
    assert run["slow_tier"] and run["slow_tier"][0]["slow_bytes"] <= run["slow_tier"][0]["budget_bytes"]


def test_an_interrupted_run_resumes_from_its_journal_with_the_same_outcomes(model_dir, tmp_path, monkeypatch):
    """A run killed after its first item and rerun with the same journal computes only the rest and
    returns the outcomes of an unbroken run."""
    import dataclasses

    from kvstate.lab.journal import Journal, identity
    from kvstate.lab.semantic.bench import run_methods

    _, model, tok = model_dir
    items = build_items(tok, "niah_single", 128, 2, 0)
    seg = SegmentConfig(sinks=2, recent=8, max_span=8)
    runs = [("full", 1.0), ("sekv", 0.9), ("quest", 0.5), ("sekv", 0.02)]  # the last one fails: below the minimum
    ident = identity({"runs": runs}, [], [])
    unbroken, failed_ref = run_methods(runs, model, tok, items, None, seg)

    class Killed(Exception):
        pass

    calls = []

    def kill_after_first_item():
        calls.append(1)
        if len(calls) == len(runs):  # the first item's last run: it is journaled before this call
            raise Killed

    path = tmp_path / ".eval.json.journal"
    with pytest.raises(Killed):
        run_methods(runs, model, tok, items, None, seg, progress=kill_after_first_item, journal=Journal(path, ident))
    resumed = Journal(path, ident)
    assert resumed.resumed == 1
    from kvstate.lab.semantic import bench

    prefills = []
    real = bench.prefill
    monkeypatch.setattr(bench, "prefill", lambda m, it: prefills.append(it.index) or real(m, it))
    got, failed = run_methods(runs, model, tok, items, None, seg, journal=resumed)
    assert prefills == [items[1].index]  # only the item the killed part had not finished
    assert failed == failed_ref and [e["budget"] for e in failed] == [0.02]
    assert {o.method for o in got} == {"full", "sekv", "quest"}
    drop = ("decode_s",)
    assert [{k: v for k, v in dataclasses.asdict(o).items() if k not in drop} for o in got] == \
        [{k: v for k, v in dataclasses.asdict(o).items() if k not in drop} for o in unbroken]
    assert len(resumed.units) == 2
