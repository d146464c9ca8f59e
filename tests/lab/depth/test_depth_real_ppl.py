"""Held-out perplexity of the depth fine-tunes: pooled perplexity and the paired ratio written out, the family's
worst ratio per model, the driver on tiny models, and too many windows refused with the most there are."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from kvstate.depth.attention import layer_specs
from kvstate.errors import KVStateError
from kvstate.lab.depth import rcla_eval as ev
from kvstate.lab.depth import real_ppl as rp
from kvstate.lab.experiment import Experiment, run_items
from kvstate.models.tiny import tiny_model
from tests.lab.models.test_real_model import MODEL, needs_model


def _experiment(methods: tuple[str, ...], n: int) -> Experiment:
    return Experiment(axis="depth", name="t", methods=methods, seeds=(7,), tasks=(rp.TASK,), lengths=(64,), n=n,
                      reference=ev.BASE, code=("lab/scoring.py",))


def test_the_summary_pools_perplexity_and_gives_the_ratio_to_the_unmodified_model():
    methods = ("base", "ft", "ft:keep@0.5", "ft:top_shared@0.5")
    recs = [{"extra": {"base": {"nll": 10.0 + i, "tokens": 63}, "ft": {"nll": 10.5 + i, "tokens": 63},
                       "ft:keep@0.5": {"nll": 12.0 + i, "tokens": 63}, "ft:top_shared@0.5": {"nll": 20.0 + i,
                                                                                          "tokens": 63}}}
            for i in range(6)]
    s = rp.summary(_experiment(methods, 6), recs)
    by = {r["method"]: r for r in s["rows"]}
    base = math.exp(sum(10.0 + i for i in range(6)) / (6 * 63))
    assert by["base"]["ppl"] == pytest.approx(base, abs=1e-3) and "ratio" not in by["base"]
    want = math.exp(sum(12.0 + i for i in range(6)) / (6 * 63)) / base
    assert by["ft:keep@0.5"]["ratio"] == pytest.approx(want, abs=1e-3)
    lo, hi = by["ft:keep@0.5"]["ratio_ci"]
    assert lo <= by["ft:keep@0.5"]["ratio"] <= hi
    assert s["models"]["ft"]["worst"] == "ft:top_shared@0.5" and s["models"]["ft"]["own_ratio"] > 1


@torch.inference_mode()
def test_the_driver_scores_every_model_under_every_pattern_per_window():
    kw = {"num_hidden_layers": 4, "vocab_size": 128}
    models = {ev.BASE: tiny_model("llama", seed=2, **kw), "ft": tiny_model("llama", seed=3, **kw)}
    rows = ev.family(layer_specs(models["ft"].config), draws=1)
    texts = [torch.randint(3, 128, (64,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(2)]
    e = _experiment(ev.method_names(["ft"], rows), 2)
    doc = run_items(e, rp.Measure(models, rows, texts, lambda _m: None))
    recs = doc["items"]
    assert all(set(r["extra"]) == set(e.methods) and r["extra"]["ft"]["tokens"] == 63 for r in recs)
    with torch.no_grad():  # the unmodified model's NLL written out for window 0
        ids = torch.tensor([texts[0]])
        want = torch.nn.functional.cross_entropy(models["base"](ids).logits[0, :-1], ids[0, 1:], reduction="sum")
    assert recs[0]["extra"]["base"]["nll"] == pytest.approx(want.item(), rel=1e-4)
    assert len({r["extra"][m]["nll"] for r in recs[:1] for m in e.methods}) > 2  # patterns change the NLL


@needs_model
def test_more_windows_than_the_held_out_text_has_are_refused():
    from kvstate.models.loading import load_tokenizer

    tok = load_tokenizer(Path(MODEL))
    assert len(rp.windows(tok, 256, 2)) == 2
    with pytest.raises(KVStateError, match="ask for at most"):
        rp.windows(tok, 4096, 10_000)
