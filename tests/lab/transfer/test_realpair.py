"""The real pair's parts: LoRA adapters and their merge, the fine-tune's rows and resumption, the premise's drift."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvstate.errors import InputFileError, KVStateError
from kvstate.lab.cached_reply import prefill, reply_from
from kvstate.lab.harness import load_reference
from kvstate.lab.transfer import lora
from kvstate.lab.transfer.real_prompts import json_reply
from kvstate.lab.transfer.realpair import FinetuneConfig, lr_at, make_row
from kvstate.lab.transfer.realpair_eval import drift

REPO = Path(__file__).resolve().parents[3]
TOY = REPO / "models/ref-attn"
REAL = REPO / "models/smollm2-135m-instruct"
needs_real = pytest.mark.skipif(not (REAL / "manifest.json").is_file(), reason="make setup converts the real model")


def _trained_adapters(model: torch.nn.Module, cfg: lora.LoraConfig) -> dict[str, lora.LoraLinear]:
    adapters = lora.attach(model, cfg, seed=3)
    g = torch.Generator().manual_seed(5)
    for m in adapters.values():  # B starts at zero: give it a value so the merge has something to add
        m.lora_b.data.copy_(torch.randn(m.lora_b.shape, generator=g) * 0.05)
    return adapters


def test_merged_weights_give_the_adapted_models_logits(tmp_path: Path) -> None:
    cfg = lora.LoraConfig(rank=4, alpha=8.0)
    wrapped, _ = load_reference(TOY)
    adapters = _trained_adapters(wrapped, cfg)
    lora.save_factors(tmp_path / lora.FACTORS, lora.factors(adapters), cfg, {"base": str(TOY)}, dtype=torch.float32)
    tensors, back, meta = lora.read_factors(tmp_path / lora.FACTORS)
    assert back == cfg and meta == {"base": str(TOY)}
    plain, _ = load_reference(TOY)
    base_logits = plain(torch.arange(5, 40)[None]).logits
    assert lora.merge_into(plain, tensors, cfg, tmp_path) == len(adapters) == 4 * 7
    ids = torch.arange(5, 40)[None]
    with torch.no_grad():
        a, b = wrapped(ids).logits, plain(ids).logits
    assert torch.allclose(a, b, atol=1e-4, rtol=0) and not torch.allclose(base_logits, b, atol=1e-2)


def test_a_fresh_adapter_is_the_base_model() -> None:
    model, _ = load_reference(TOY)
    ids = torch.arange(3, 30)[None]
    with torch.no_grad():
        before = model(ids).logits
        lora.attach(model, lora.LoraConfig(rank=2), seed=0)
        after = model(ids).logits
    assert torch.allclose(before, after, atol=1e-6) and sum(p.requires_grad for p in model.parameters()) == 4 * 7 * 2


def test_factors_of_another_model_or_a_corrupt_file_are_refused(tmp_path: Path) -> None:
    cfg = lora.LoraConfig(rank=2)
    model, _ = load_reference(TOY)
    tensors = lora.factors(lora.attach(model, cfg, seed=0))
    wrong = {k: torch.zeros(v.shape[0], v.shape[1] + 1) for k, v in tensors.items()}
    plain, _ = load_reference(TOY)
    with pytest.raises(InputFileError, match="does not fit this model"):
        lora.merge_into(plain, wrong, cfg, tmp_path)
    (tmp_path / "bad.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(InputFileError, match="corrupt"):
        lora.read_factors(tmp_path / "bad.safetensors")
    with pytest.raises(KVStateError, match="name no linear map"):
        lora.attach(load_reference(TOY)[0], lora.LoraConfig(targets=("qkv",)), seed=0)


def test_the_schedule_warms_up_and_decays_to_its_floor() -> None:
    cfg = FinetuneConfig(steps=100, lr=1e-3, warmup=10, final_lr_share=0.1)
    assert lr_at(cfg, 0) == pytest.approx(1e-4) and lr_at(cfg, 9) == pytest.approx(1e-3)
    assert lr_at(cfg, 99) == pytest.approx(1e-4, rel=0.01) and lr_at(cfg, 50) < lr_at(cfg, 20)
    with pytest.raises(KVStateError, match="dev seed"):
        FinetuneConfig(seed=1062)


@needs_real
def test_rows_are_a_function_of_the_step_and_task_rows_end_in_the_json_reply() -> None:
    from kvstate.models.loading import load_tokenizer

    tok = load_tokenizer(REAL)
    cfg = FinetuneConfig(lm_share=0.5)
    rows = [make_row(tok, cfg, step, k) for step in range(6) for k in range(2)]
    assert rows == [make_row(tok, cfg, step, k) for step in range(6) for k in range(2)]
    kinds = {kind for _, _, kind in rows}
    assert "text" in kinds and len(kinds) >= 2
    for ids, reply_at, kind in rows:
        assert len(ids) <= cfg.length
        if kind == "text":
            assert reply_at == len(ids)
        else:
            reply = tok.decode(ids[reply_at:])
            assert reply.startswith('{"answer": [') and reply.endswith("<|im_end|>")
            assert json.loads(reply.removesuffix("<|im_end|>")) == json.loads(json_reply(tuple(json.loads(
                reply.removesuffix("<|im_end|>"))["answer"])))


def test_drift_is_one_on_equal_caches_and_raw_reuse_of_ones_own_cache_is_the_oracle() -> None:
    model, tok = load_reference(TOY)
    ids = torch.tensor([tok("the cat sat on the mat and the dog ran to the red house")["input_ids"]])
    a, b = prefill(model, ids), prefill(model, ids)
    d = drift(a, b)
    assert len(d["k"]) == model.config.num_hidden_layers and min(d["k"] + d["v"]) > 0.9999
    other, _ = load_reference(REPO / "models/ref-attn-ft2")
    c = prefill(other, ids)
    assert min(drift(a, c)["k"]) < 0.99  # a fine-tune's cache is not the base's
    assert reply_from(model, tok, ids, a, 6) == reply_from(model, tok, ids, b, 6)
    with torch.no_grad():
        full = model(ids).logits[0, -1]
    out = model(ids[:, -1:], cache=a, use_cache=True).logits[0, -1]
    assert torch.allclose(full, out, atol=1e-4)


def test_ridge_needs_a_calibrated_codec_directory(tmp_path, capsys) -> None:
    from kvstate.lab.transfer import realpair

    assert realpair.main(["ridge", "--codec", str(tmp_path / "none")]) == 2
    assert "calibrate` first" in capsys.readouterr().err
