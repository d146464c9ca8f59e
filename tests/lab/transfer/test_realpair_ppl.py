"""Held-out perplexity under transfer (issue 44) on the 4-layer pair: the oracle's NLL through its cache equals a
full forward's, a model against itself agrees with itself, agreement and the summary against brute force, and
the dev / test split of the text."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvstate.errors import KVStateError
from kvstate.lab.experiment import Item
from kvstate.lab.perplexity import continuation_nll
from kvstate.lab.transfer import realpair_ppl as R
from kvstate.lab.workloads import pydoc_text
from kvstate.transfer import methods as registry
from kvstate.transfer.codec import Codec
from kvstate.transfer.methods import MethodContext

REPO = Path(__file__).resolve().parents[3]
K, N, G = 24, 40, 8  # context, window, greedy tokens


def test_agreement_against_brute_force() -> None:
    assert R.agreement([1, 2, 3, 4], [1, 2, 3, 4]) == (1.0, 4)
    assert R.agreement([1, 9, 3, 4], [1, 2, 3, 4]) == (0.75, 1)
    assert R.agreement([9, 9], [1, 2]) == (0.0, 0)
    with pytest.raises(KVStateError, match="equal"):
        R.agreement([1], [1, 2])


@pytest.fixture(scope="module")
def pair():
    from kvstate.lab.harness import load_reference

    p, tok = load_reference(REPO / "models/ref-attn")
    c, _ = load_reference(REPO / "models/ref-attn-ft2")
    codec_dir = REPO / "models/codec-ref-attn-ft2"
    ctx = MethodContext(codec=Codec.load(codec_dir), codec_dir=codec_dir)
    text = " ".join(["the cat sat on the mat and the dog ran home while the bird sang"] * 12)
    return p, c, tok, ctx, pydoc_text.windows(tok, text, N, 2)


def _measure(pair, producer, names):
    p, c, tok, ctx, texts = pair
    contexts = {m: registry.context(m, ctx) for m in names}
    return R.Measure(producer if producer is not None else p, c, tok, contexts, texts, lambda _m: None, context=K,
                     greedy=G)


def test_the_oracle_is_the_full_forward_and_a_model_against_itself_agrees(pair) -> None:
    _p, c, _tok, _ctx, texts = pair
    got = _measure(pair, c, ["raw"])(Item(1000, K, R.TASK, 0))  # the consumer as its own producer
    ids = torch.tensor([texts[0]])
    full = continuation_nll(c, ids[0], start=K)  # no cache: one forward over the window
    oracle = got.extra["methods"][R.ORACLE]
    assert oracle["tokens"] == N - K - 1 and abs(oracle["nll"] - full.nll) < 1e-3 * max(1.0, abs(full.nll))
    floor = got.extra["methods"][R.FLOOR]  # the own cache through bf16: close to the oracle, measured
    assert abs(floor["nll"] - oracle["nll"]) < 5e-2 * max(1.0, abs(oracle["nll"])) and 0.0 <= got.scores[R.FLOOR] <= 1
    assert set(got.scores) == {R.ORACLE, R.FLOOR, "raw"}
    raw = got.extra["methods"]["raw"]
    assert got.scores["raw"] == 1.0 and raw["first_divergence"] == G  # fp16 wire rounding only
    assert abs(raw["nll"] - oracle["nll"]) < 1e-2 * max(1.0, abs(oracle["nll"])) and raw["recomputed"] == 0


def test_another_producer_is_measured_not_assumed(pair) -> None:
    got = _measure(pair, None, ["raw"])(Item(1000, K, R.TASK, 1))
    assert got.extra["methods"]["raw"]["nll"] != got.extra["methods"][R.ORACLE]["nll"]
    assert 0.0 <= got.scores["raw"] <= 1.0 and got.extra["methods"]["raw"]["bf16_share"] > 0.0


def _rec(oracle: list[float], other: list[float]) -> list[dict]:
    return [{"extra": {"methods": {R.ORACLE: {"nll": a, "tokens": 10, "first_divergence": 8},
                                   "raw": {"nll": b, "tokens": 10, "first_divergence": 2, "bf16_share": 0.5,
                                           "recomputed": 0}}}} for a, b in zip(oracle, other, strict=True)]


def test_bf16_rounding_changes_a_copy_only() -> None:
    from transformers import DynamicCache

    cache = DynamicCache()
    k = torch.tensor([[[[1.0 + 2 ** -12, 3.0]]]])
    cache.update(k.clone(), k.clone(), 0)
    out = R.bf16_rounded(cache)
    assert out.layers[0].keys[0, 0, 0, 0].item() == 1.0 and cache.layers[0].keys[0, 0, 0, 0].item() == 1.0 + 2 ** -12


def test_the_summary_ratio_and_decision_against_brute_force() -> None:
    import math

    oracle = [20.0, 22.0, 18.0, 25.0, 21.0, 19.0, 23.0, 24.0]
    worse = [x * 1.5 for x in oracle]
    got = R.summary([R.ORACLE, "raw"], _rec(oracle, worse), seed=1)
    raw = got["rows"][1]
    want = math.exp(sum(worse) / 80) / math.exp(sum(oracle) / 80)
    assert abs(raw["ratio"] - want) < 1e-3 and raw["status"] == "missed" and raw["first_divergence"] == 2
    same = R.summary([R.ORACLE, "raw"], _rec(oracle, [x + 0.001 * (i % 3) for i, x in enumerate(oracle)]), seed=1)
    assert same["rows"][1]["status"] == "met" and same["rows"][1]["ratio_ci"][1] <= R.PPL_LIMIT


def test_dev_seeds_read_the_licence_text_and_test_seeds_pythons_topics(pair) -> None:
    tok = pair[2]
    dev, what_dev = R.corpus(493)
    test, what_test = R.corpus(1101)
    assert "licence" in what_dev and "pydoc_data" in what_test and dev != test and len(test) > 10 * len(dev) / 2
    with pytest.raises(KVStateError, match="at most --n"):
        pydoc_text.windows(tok, "a b c", 4, 3)


def test_the_module_prints_every_row_floor_included(monkeypatch, capsys) -> None:
    rows = [{"method": R.ORACLE, "ppl": 7.0, "first_divergence": 64.0},
            {"method": R.FLOOR, "ppl": 7.0, "ratio": 1.0, "ratio_ci": [0.99, 1.01], "first_divergence": 9.0},
            {"method": "raw", "ppl": 8.0, "ratio": 1.1, "ratio_ci": [1.05, 1.2], "status": "missed",
             "first_divergence": 2.0}]
    monkeypatch.setattr("kvstate.lab.experiment.run_items", lambda *a, **k: {"appendix": {"rows": rows}})
    monkeypatch.setattr("kvstate.models.loading.load_model", lambda *a, **k: object())
    monkeypatch.setattr("kvstate.transfer.codec.Codec.load", lambda *a, **k: type("C", (), {"check_models": lambda *x: None})())
    monkeypatch.setattr("kvstate.lab.transfer.realpair_bench.ridge_artifacts", lambda *a, **k: {})
    assert R.main(["--methods", "raw", "--no-droidspeak", "--n", "1", "--seed", "7"]) == 0
    err = capsys.readouterr().err
    assert "own_bf16: ppl 7.000 ratio 1.000 [0.990, 1.010] (floor)" in err and "missed" in err
