"""The PATCH probe on tiny models: every replacement of a consumer's own state by an exact one scores the same
as the oracle, the budget rows patch k layers, and a test seed is refused."""

from __future__ import annotations

import pytest
import torch

from kvstate.errors import KVStateError
from kvstate.lab.transfer.patch_probe import TASKS, run_probe
from kvstate.lab.workloads.tokenizer import build_tokenizer
from kvstate.models.tiny import tiny_model
from kvstate.transfer.calibrate import CalibrationConfig, calibrate_on


def test_exact_replacements_score_as_the_oracle_and_budget_rows_patch_k_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.set_num_threads(1)
    seen: set[str] = set()

    def fingerprint(_ex: object, pred: str) -> float:  # equal scores = equal continuations (a random model scores 0)
        seen.add(pred)
        return (hash(pred) % 997) / 997

    monkeypatch.setattr("kvstate.lab.transfer.patch_probe.score", fingerprint)
    tok = build_tokenizer()
    model = tiny_model("qwen3", seed=0, vocab_size=len(tok), max_position_embeddings=4096)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, len(tok), (1, 48), generator=g) for _ in range(8)]
    cfg = CalibrationConfig(rank_k=16, rank_v=16, rank_h=64, bits=32, prefixes=8, length=48, suffix=8,
                            aligner_steps=0, aligner_hidden=8)
    codec = calibrate_on(model, model, prompts, cfg)  # producer == consumer, full rank: every decode is exact
    pca = calibrate_on(model, model, prompts, CalibrationConfig(**{**cfg.__dict__, "reuse_map": "pca"}))
    out = run_probe(model, model, tok, {"regress": codec}, n=1, seed=0, length=96, reuse_codecs={"pca": pca})
    oracle = out["layer"]["oracle"]
    assert set(oracle) == set(TASKS) and len(seen) == 2  # one continuation per item, whatever the cache
    names = {"oracle", *(f"{v} at layer {i}" for v in ("raw", "reuse", "reuse (pca)", "patch (regress)")
                         for i in range(2))}
    assert out["reuse"] == {"pca": oracle} and set(out["calibration"]) == {"regress", "reuse pca"}
    assert set(out["layer"]) == names
    assert all(cells == oracle for cells in out["layer"].values())
    rows = out["budget"]["regress"]
    assert [r["k"] for r in rows] == [0, 1, 2] and [len(r["layers"]) for r in rows] == [0, 1, 2]
    assert all({t: r[t] for t in TASKS} == oracle for r in rows)


def test_a_test_seed_is_refused() -> None:
    with pytest.raises(KVStateError, match="dev seed"):
        run_probe(None, None, None, {}, n=1, seed=1000, length=96)
