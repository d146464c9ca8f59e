"""The 16:1 run on the real model: every set names registered methods or kvpress presses, the test set carries issue
48's 16:1 targets (>= 0.9x full, >= every press of the run), the summary pairs the proposed configuration with every
equal-memory baseline and checks the compressed context against 0.0625 x bf16; the kvpress worker answers item by
item in kvpress's own environment, counts a masking press (KVzip) by what attention can still read, and a runner
that dies is one error naming its stderr."""

import sys
from pathlib import Path

import pytest

from kvstate.lab import experiment as X
from kvstate.lab.semantic import methods as registry
from kvstate.lab.semantic import realmodel16 as R
from kvstate.lab.semantic.baselines_kvpress import KVPressEnvError
from kvstate.lab.semantic.kvpress_worker import PressWorker, is_press
from kvstate.lab.semantic.protocol import build_items
from kvstate.models import tiny_model


def test_every_set_names_a_registered_method_or_a_press():
    for labels in R.SETS.values():
        for lab in labels:
            if not is_press(R.RUNS[lab].method):
                registry.get(R.RUNS[lab].method)
    assert R.PROPOSED in R.SETS["test"] and "full" in R.SETS["test"]


def test_the_test_set_targets_full_and_every_press_it_runs():
    t = R.targets(R.SETS["test"])
    presses = [x for x in R.SETS["test"] if is_press(R.RUNS[x].method)]
    assert presses and [(x.method, x.against, x.threshold) for x in t] == [
        (R.PROPOSED, "full", -0.1 * R.FULL_2K), *[(R.PROPOSED, p, 0.0) for p in presses]]
    assert R.targets(("full", "kvzip_local@0.0625")) == () and R.targets((R.PROPOSED, "KVzipPress@0.0625")) == ()


def _record(task: str, i: int, scores: dict, ctx: dict) -> dict:
    extra = {lab: {"memory_context_bf16": ctx[lab], "bf16": {"memory": ctx[lab] + 0.02, "reads": ctx[lab] + 0.02},
                   "seconds": 1.0} for lab in scores}
    return {"task": task, "length": 2048, "index": i, "scores": scores, "extra": extra}


def test_the_summary_pairs_every_equal_memory_baseline_and_checks_the_context_memory():
    labels = ("full", R.PROPOSED, "KVzipPress@0.0625")
    e = X.Experiment(axis="resolution", name=R.EXPERIMENT, methods=labels, seeds=(490,),
                     tasks=("real_niah_single", "real_niah_multikey"), lengths=(2048,), n=4, reference="full")
    recs = [_record(t, i, {"full": 1.0, R.PROPOSED: float(i % 2), "KVzipPress@0.0625": 0.0},
                    {"full": 1.0, R.PROPOSED: 0.0625, "KVzipPress@0.0625": 0.0626})
            for t in e.tasks for i in range(4)]
    s = R.summary(e, recs)
    by = {(r["method"], r["task"]): r for r in s["rows"]}
    assert by[(R.PROPOSED, "real_niah_single")]["score"] == 0.5 and by[("full", "real_niah_single")]["n"] == 4
    pairs = {(p["b"], p["task"]): p["difference"] for p in s["pairs"]}
    assert pairs[("full", "pooled (solved)")] == -0.5 and pairs[("KVzipPress@0.0625", "real_niah_multikey")] == 0.5
    checks = {c["method"]: c["memory_context_le_0.0625_bf16"] for c in s["memory_checks"]}
    assert checks == {"full": False, R.PROPOSED: True, "KVzipPress@0.0625": False}


def test_a_runner_that_dies_is_one_error_naming_its_stderr(tmp_path):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'no model at that path' >&2\nexit 3\n")
    fake.chmod(0o755)
    with pytest.raises(KVPressEnvError, match=r"exited with code 3: no model at that path"):
        PressWorker(fake, tmp_path).start()


def test_the_worker_answers_item_by_item_and_counts_masked_keys_as_dropped(model_dir, kvpress_python):
    d, _, tok = model_dir
    items = build_items(tok, "niah_single", 128, 2, 0)
    with PressWorker(kvpress_python, d) as w:
        assert w.versions["transformers"] and sys.executable != str(kvpress_python)
        for it in items:
            rows = w.run(it, ["StreamingLLMPress", "NoSuchPress"], [0.25])
            by = {r["press"]: r for r in rows}
            assert "kvpress has no NoSuchPress" in by["NoSuchPress"]["error"]
            r = by["StreamingLLMPress"]
            assert r["index"] == it.index and r["context_full_bytes"] > 0
            assert 0.2 <= r["context_bytes"] / r["context_full_bytes"] <= 0.3 and r["total_bytes"] < 0.4 * r["full_bytes"]


def test_a_masking_press_is_counted_by_the_keys_attention_can_still_read():
    """kvpress's fake compression (KVzip, AdaKV) keeps every K/V and masks some keys per head: the runner's count
    drops the masked ones (module.masked_key_indices), layer by layer."""
    import importlib.util
    from types import SimpleNamespace as NS

    import torch

    spec = importlib.util.spec_from_file_location("runner", Path(R.__file__).with_name("kvpress_runner.py"))
    runner = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(runner)
    keys = [torch.zeros(1, 2, 10, 4), torch.zeros(1, 2, 10, 4)]
    cache = NS(layers=[NS(keys=k, values=torch.zeros_like(k)) for k in keys])
    masked = (torch.zeros(7, dtype=torch.long), torch.zeros(7, dtype=torch.long), torch.arange(7))
    model = NS(model=NS(layers=[NS(self_attn=NS(layer_idx=0, masked_key_indices=masked)),
                                NS(self_attn=NS(layer_idx=1, masked_key_indices=None))]))
    per_key = 2 * 4 * 4  # K and V of one head and token, fp32
    assert runner._bytes(cache) == 2 * 2 * 10 * per_key and runner._masked(model, cache) == 7 * per_key
    assert runner._held(model, cache) == (40 - 7) * per_key


def test_the_zip_methods_are_the_library_retention_at_their_bits_and_hold_their_bf16_memory():
    import torch
    from transformers import DynamicCache

    from kvstate.lab.semantic import bf16
    from kvstate.semantic import SegmentConfig

    model = tiny_model("qwen3")
    ids = torch.randint(3, 128, (1, 150), generator=torch.Generator().manual_seed(0))
    pre = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, position_ids=torch.arange(150)[None], cache=pre)

    class Tok:
        def encode(self, text, add_special_tokens=False):
            return [5, 6]

    ctx = registry.Context(None, SegmentConfig(sinks=2, recent=8))
    want = {"sekv_zip": (4, 4), "sekv_zip_v2": (4, 2), "sekv_zip8": (8, 8), "kvzip_local": (16, 16)}
    for name, bits in want.items():
        m = registry.get(name)
        r = m.retention(0.3, ctx)
        assert (r.bits, r.v_bits, r.memory, r.sinks, r.recent) == (*bits, 0.3, 2, 8)
        cache = m.build(model, Tok(), ids[0].tolist(), 0.3, ctx, registry.Prefilled(pre, torch.zeros(150)))
        held = bf16.counts(cache)
        assert 0 < held.total_bytes <= 0.3 * held.full_bytes
