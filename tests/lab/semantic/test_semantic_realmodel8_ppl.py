"""Held-out perplexity at 8:1 (issue 48) on the 4-layer reference model: the full cache fed one token at a time
scores what one forward scores, a retention that keeps every token exact scores what the full cache scores (and a
real 8:1 one does not), the floor is measured, the summary's ratios and decisions against brute force, and the
experiment refuses what it cannot run."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from kvstate.errors import KVStateError
from kvstate.lab.experiment import Item
from kvstate.lab.perplexity import continuation_nll
from kvstate.lab.semantic import realmodel as base
from kvstate.lab.semantic import realmodel8_ppl as R
from kvstate.lab.workloads import pydoc_text

REPO = Path(__file__).resolve().parents[3]
K, N = 256, 272  # context (8:1 holds its 20 exact anchors), window (K + 15 scored tokens + 1)
KEEP_ALL = "kvzip_local@1.0"  # 16-bit retention at the whole bf16 budget: every token kept exact


@pytest.fixture(scope="module")
def ref():
    from kvstate.lab.harness import load_reference

    model, tok = load_reference(REPO / "models/ref-attn")
    text = " ".join(["the cat sat on the mat and the dog ran home while the bird sang"] * 40)
    return model, tok, pydoc_text.windows(tok, text, N, 2)


@pytest.fixture
def keep_all():
    base.RUNS[KEEP_ALL] = base.Run(KEEP_ALL, "kvzip_local", 1.0)
    yield KEEP_ALL
    del base.RUNS[KEEP_ALL]


def test_top1_agreement_against_brute_force() -> None:
    assert R.top1_agreement([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
    assert R.top1_agreement([1, 9, 3, 9], [1, 2, 3, 4]) == 0.5
    with pytest.raises(KVStateError, match="equal"):
        R.top1_agreement([1], [1, 2])
    with pytest.raises(KVStateError, match="equal"):
        R.top1_agreement([], [])


def test_the_full_cache_fed_one_token_at_a_time_is_one_forward_and_keep_all_is_the_full_cache(ref, keep_all):
    model, tok, texts = ref
    got = R.Measure(model, tok, [keep_all, R.PROPOSED], texts, context=K)(Item(0, K, R.TASK, 1))
    full = continuation_nll(model, torch.tensor(texts[1]), start=K)  # no cache: one forward over the window
    e = got.extra
    assert e[R.REFERENCE]["tokens"] == N - K - 1 == full.tokens
    assert abs(e[R.REFERENCE]["nll"] - full.nll) < 1e-3 * max(1.0, abs(full.nll))
    # every token kept at 16 bits: the same NLL and the same top-1 tokens as the full cache
    assert abs(e[keep_all]["nll"] - e[R.REFERENCE]["nll"]) < 1e-3 * max(1.0, abs(full.nll))
    assert got.scores[keep_all] == 1.0 and e[keep_all]["context_memory_bf16"] >= 0.99
    # 8:1 retention holds about a tenth of the context and changes the continuation's NLL
    assert e[R.PROPOSED]["context_memory_bf16"] <= 0.3 and e[R.PROPOSED]["nll"] != e[R.REFERENCE]["nll"]
    floor = e[R.FLOOR]  # the full cache through bf16: close to the full cache, measured
    assert abs(floor["nll"] - e[R.REFERENCE]["nll"]) < 5e-2 * max(1.0, abs(full.nll))
    assert 0.0 <= got.scores[R.FLOOR] <= 1.0 and got.scores[R.REFERENCE] == 1.0


def test_scored_refuses_a_window_with_nothing_to_score(ref) -> None:
    model, _tok, texts = ref
    with pytest.raises(KVStateError, match="at least one token"):
        R.scored(model, texts[0][:K + 1], None, K)


def _records(nlls: dict[str, list[float]], tokens: int = 10) -> list[dict]:
    n = len(next(iter(nlls.values())))
    return [{"scores": {m: 1.0 if m == R.REFERENCE else 0.5 for m in nlls},
             "extra": {m: {"nll": v[i], "tokens": tokens, "memory_bf16": 0.15 if m == R.PROPOSED else 1.0,
                           "context_memory_bf16": 0.1 if m == R.PROPOSED else 1.0} for m, v in nlls.items()}}
            for i in range(n)]


def test_the_summary_ratio_and_decision_against_brute_force() -> None:
    full = [20.0, 22.0, 18.0, 21.0, 19.0, 20.5, 19.5, 20.0]
    worse = [x + 1.0 + 0.1 * (i % 3) for i, x in enumerate(full)]  # ~+0.11 nat a token, not the same in every window
    recs = _records({R.REFERENCE: full, R.FLOOR: [x + 0.001 * (i % 2) for i, x in enumerate(full)], R.PROPOSED: worse})
    rows = {r["method"]: r for r in R.summary((R.REFERENCE, R.FLOOR, R.PROPOSED), recs, seed=1)["rows"]}
    want = math.exp(sum(worse) / 80) / math.exp(sum(full) / 80)  # ~1.115
    assert abs(rows[R.PROPOSED]["ratio"] - want) < 1e-3 and rows[R.PROPOSED]["ratio_ci"][0] > R.PPL_LIMIT
    assert rows[R.PROPOSED]["status"] == "missed" and rows[R.PROPOSED]["top1_agreement"] == 0.5
    assert rows[R.PROPOSED]["memory_bf16_max"] == 0.15 and rows[R.PROPOSED]["context_memory_bf16_max"] == 0.1
    assert "status" not in rows[R.FLOOR] and "ratio" in rows[R.FLOOR]  # the floor: measured, never decided
    assert "ratio" not in rows[R.REFERENCE]
    close = _records({R.REFERENCE: full, R.PROPOSED: [x + 0.01 * (i % 2) for i, x in enumerate(full)]})  # ~+0.05%
    row = R.summary((R.REFERENCE, R.PROPOSED), close, seed=1)["rows"][1]
    assert row["status"] == "met" and row["ratio_ci"][1] <= R.PPL_LIMIT


def test_the_experiment_carries_the_full_cache_the_floor_and_its_settings(tmp_path) -> None:
    e = R.experiment(tmp_path, list(R.METHODS), 100, 1104, "Python's topics")
    assert e.methods == (R.REFERENCE, R.FLOOR, *R.METHODS) and e.reference == R.REFERENCE
    assert e.settings["ppl_limit"] == R.PPL_LIMIT == 1.02 and "lab/semantic/realmodel8_ppl.py" in e.code
    for lab in R.METHODS:
        assert lab in base.RUNS


def test_an_unknown_method_is_refused_in_one_line_before_the_weights_load(capsys) -> None:
    assert R.main(["--methods", "nope", "--seed", "496", "--n", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "nope" in err and R.PROPOSED in err
