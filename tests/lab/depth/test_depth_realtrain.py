"""The real model's R-CLA fine-tune: the teacher is the unmodified model, the loss against a written-out KL, the
rows, and a resumed run equal to an uninterrupted one (factors, optimizer and the routing's draws)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvstate.errors import KVStateError
from kvstate.lab.depth import realtrain as rt
from kvstate.lab.transfer import lora
from kvstate.models.tiny import tiny_model
from tests.lab.models.test_real_model import MODEL, needs_model


def test_the_config_refuses_a_test_seed_an_unknown_pattern_and_annealing_a_fixed_pattern() -> None:
    with pytest.raises(KVStateError, match="dev seed"):
        rt.DepthFinetuneConfig(seed=1070)
    with pytest.raises(KVStateError, match="choose one of rcla, cla2, family"):
        rt.DepthFinetuneConfig(pattern="cla3")
    with pytest.raises(KVStateError, match="no p to anneal"):
        rt.DepthFinetuneConfig(pattern="cla2", anneal=0.3)


def test_with_the_adapters_off_the_model_is_the_base_and_they_come_back_on() -> None:
    model = tiny_model("llama", seed=1, num_hidden_layers=2)
    ids = torch.arange(3, 40)[None]
    with torch.no_grad():
        base = model(ids).logits
        adapters = lora.attach(model, lora.LoraConfig(rank=2, alpha=4.0), seed=0)
        for m in adapters.values():
            m.lora_b.data.fill_(0.05)
        adapted = model(ids).logits
        with rt.adapters_off(adapters):
            off = model(ids).logits
        again = model(ids).logits
    assert torch.allclose(off, base, atol=1e-6) and not torch.allclose(adapted, base, atol=1e-3)
    assert torch.equal(again, adapted) and {m.scale for m in adapters.values()} == {2.0}


def _kl(teacher: torch.Tensor, student: torch.Tensor) -> torch.Tensor:
    """KL(teacher || student) per position, written out over the vocabulary."""
    p = torch.softmax(teacher.double(), -1)
    return (p * (p.log() - torch.log_softmax(student.double(), -1))).sum(-1)


def test_the_loss_is_the_weighted_kl_plus_the_replys_cross_entropy() -> None:
    g = torch.Generator().manual_seed(0)
    t, v, reply_at = 12, 17, 8
    teacher, student = torch.randn(t, v, generator=g), torch.randn(t, v, generator=g)
    ids = torch.randint(0, v, (t,), generator=g).tolist()
    cfg = rt.DepthFinetuneConfig(reply_share=0.4, ce_weight=0.5)
    loss, parts = rt.row_loss(student, teacher, ids, reply_at, cfg)
    kl = _kl(teacher[:-1], student[:-1])
    ce = -torch.log_softmax(student[:-1].double(), -1)[torch.arange(reply_at - 1, t - 1), ids[reply_at:]].mean()
    want = 0.6 * kl[: reply_at - 1].mean() + 0.4 * (kl[reply_at - 1:].mean() + 0.5 * ce)
    assert loss.item() == pytest.approx(want.item(), rel=1e-5)
    assert parts["reply_ce"] == pytest.approx(ce.item(), rel=1e-5)
    same, parts_same = rt.row_loss(teacher, teacher, ids, reply_at, cfg)  # student = teacher: only the CE is left
    assert abs(parts_same["prompt_kl"]) < 1e-6 and abs(parts_same["reply_kl"]) < 1e-6
    assert same.item() == pytest.approx(0.4 * 0.5 * parts_same["reply_ce"], rel=1e-5)
    text, tparts = rt.row_loss(student, teacher, ids, t, cfg)  # a text row: the plain mean KL
    assert text.item() == pytest.approx(kl.mean().item(), rel=1e-5) and tparts["reply_ce"] != tparts["reply_ce"]


@needs_model
def test_rows_are_reproducible_and_end_with_the_models_own_answer() -> None:
    from kvstate.models.loading import load_tokenizer

    tok = load_tokenizer(MODEL)
    cfg = rt.DepthFinetuneConfig(length=512, lm_share=0.3)
    rows = [rt.make_row(tok, cfg, step, k) for step in range(6) for k in range(2)]
    assert rows == [rt.make_row(tok, cfg, step, k) for step in range(6) for k in range(2)]
    kinds = {kind for _, _, kind in rows}
    assert "text" in kinds and kinds & set(rt.TASKS)
    for ids, reply_at, kind in rows:
        assert len(ids) <= cfg.length
        if kind == "text":
            assert reply_at == len(ids)
            continue
        reply = tok.decode(ids[reply_at:])
        question = tok.decode(ids[reply_at - 40:reply_at])
        key = rt._KEY.search(question).group(1)
        assert reply.startswith(f"The special magic number for {key} is ") and reply.endswith("<|im_end|>")


class _Stop(Exception):
    pass


@needs_model
def test_a_resumed_run_ends_where_an_uninterrupted_one_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = rt.DepthFinetuneConfig(steps=2, rows=1, length=256, save_every=1, warmup=1, lm_share=0.0)
    whole = rt.train(cfg, tmp_path / "whole", MODEL, say=lambda _m: None)
    real_row = rt.make_row

    def stop_at_step_1(tok, c, step, k):
        if step == 1:
            raise _Stop
        return real_row(tok, c, step, k)

    monkeypatch.setattr(rt, "make_row", stop_at_step_1)
    with pytest.raises(_Stop):
        rt.train(cfg, tmp_path / "cut", MODEL, say=lambda _m: None)
    assert json.loads((tmp_path / ".cut.partial" / rt.STATE).read_text())["step"] == 1
    monkeypatch.setattr(rt, "make_row", real_row)
    with pytest.raises(KVStateError, match=r"lr=0\.002 \(this run: 0\.001\)"):
        rt.train(rt.DepthFinetuneConfig(**{**cfg.__dict__, "lr": 1e-3}), tmp_path / "cut", MODEL, say=lambda _m: None)
    resumed = rt.train(cfg, tmp_path / "cut", MODEL, say=lambda _m: None)
    a, _, _ = lora.read_factors(tmp_path / "whole" / lora.FACTORS)
    b, _, _ = lora.read_factors(tmp_path / "cut" / lora.FACTORS)
    assert resumed["routing"] == whole["routing"] and resumed["tokens"] == whole["tokens"]
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a) and any(b[k].abs().sum() > 0 for k in b)
    assert not (tmp_path / ".cut.partial").exists()
    with pytest.raises(KVStateError, match="already holds a finished run"):
        rt.train(cfg, tmp_path / "cut", MODEL, say=lambda _m: None)


@needs_model
def test_a_finished_run_exports_a_bf16_delta_that_builds_the_model_and_its_curves(tmp_path: Path) -> None:
    from safetensors import safe_open

    cfg = rt.DepthFinetuneConfig(pattern="cla2", steps=1, rows=1, length=256, warmup=1, lm_share=0.0)
    rt.train(cfg, tmp_path / "run", MODEL, say=lambda _m: None)
    assert rt.main(["export", "--run", str(tmp_path / "run"), "--out", str(tmp_path / "delta")]) == 0
    with safe_open(str(tmp_path / "delta" / lora.FACTORS), framework="pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}  # noqa: SIM118
    assert rt.main(["export", "--run", str(tmp_path / "run"), "--out", str(tmp_path / "delta")]) == 2  # no overwrite
    assert rt.build(tmp_path / "delta", MODEL, tmp_path / "model") == 30 * 7
    record = json.loads((tmp_path / "model" / "finetune.json").read_text())
    assert record["config"]["pattern"] == "cla2" and record["tokens"] > 0
    doc = rt.curves({"cla2": tmp_path / "run"}, tmp_path / "curves.json")
    assert doc["runs"]["cla2"]["curve"][-1]["step"] == 1 and doc["runs"]["cla2"]["curve"][-1]["owners"] == 15.0
    with pytest.raises(KVStateError, match="exists"):
        rt.curves({"cla2": tmp_path / "run"}, tmp_path / "curves.json")


def test_nearest_draws_anneal_from_every_layer_owning_and_resume_the_same_stream() -> None:
    from kvstate.depth.patterns import LayerSpec

    layers = [LayerSpec("full_attention", 3, 64)] * 30
    a = rt._NearestDraws(layers, 0.5, seed=3, anneal=100)
    first = [a() for _ in range(10)]
    assert len(first[0].owners) >= 28  # p starts near 1
    state = a.state_dict()
    b = rt._NearestDraws(layers, 0.5, seed=3, anneal=100)
    b.load_state_dict(json.loads(json.dumps(state)))
    assert [a() for _ in range(50)] == [b() for _ in range(50)]
    late = [a() for _ in range(400)][-200:]
    mean = sum(len(p.owners) for p in late) / len(late)
    assert 14 < mean < 17  # p = 0.5 after the anneal: 1 + 29 / 2 owners on average
    with pytest.raises(KVStateError, match="choose one of paper, owner"):
        rt.DepthFinetuneConfig(rule="bogus")
    assert rt.DepthFinetuneConfig(rule="nearest").rule == "nearest"


def test_family_draws_cover_the_declared_family_uniformly_and_resume_the_same_stream() -> None:
    from kvstate.depth.patterns import LayerSpec
    from kvstate.lab.depth.rcla_eval import family

    layers = [LayerSpec("full_attention", 3, 64)] * 30
    declared = [r.pattern for r in family(layers, draws=0, nearest=rt.FAMILY_NEAREST)]
    a = rt._FamilyDraws(layers, seed=5)
    got = [a() for _ in range(400)]
    assert set(got) == set(declared) and len(declared) == 4
    assert all(70 < got.count(p) < 130 for p in declared)
    b = rt._FamilyDraws(layers, seed=5)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert [a() for _ in range(20)] == [b() for _ in range(20)]
    with pytest.raises(KVStateError, match="no p to anneal"):
        rt.DepthFinetuneConfig(pattern="family", anneal=0.3)
