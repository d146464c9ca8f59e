"""Cache-conditioned adaptation: with the adapter off the consumer is exactly the base model; trained on a
transferred cache it lowers the consumer's KL from its own prefill; another pair or codec is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvstate.models.fingerprint import model_fingerprint
from kvstate.models.tiny import tiny_model
from kvstate.transfer.adapter import Adapter, AdapterConfig, AdapterError, init_tensors, lora, train_adapter
from kvstate.transfer.calibrate import CalibrationConfig, calibrate_on
from kvstate.transfer.nonlinear import kl_div
from kvstate.transfer.recompute import suffix_logits
from tests.lib.transfer.conftest import prompts as _prompts


@pytest.fixture(scope="module")
def trained() -> tuple:
    p = tiny_model("qwen3", seed=0)
    c = tiny_model("qwen3", seed=0)
    with torch.no_grad():
        for q in c.parameters():
            q.add_(0.4 * q.std() * torch.randn(q.shape, generator=torch.Generator().manual_seed(8)))
    cfg = CalibrationConfig(rank_k=8, rank_v=8, rank_h=8, bits=8, prefixes=8, length=48, suffix=8, aligner_steps=0)
    codec = calibrate_on(p, c, _prompts(), cfg)

    def transfer(ids: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return codec.decode_layers(c, codec.encode(p, ids, patch=(), check=False), check=False)

    acfg = AdapterConfig(rank=4, steps=120, lr=3e-3, suffix=8)
    adapter = train_adapter(codec.producer_fp, c, codec.pair.hex(), transfer, _prompts(4), acfg)
    return p, c, codec, adapter, transfer


def test_adapter_off_is_the_base_consumer_exactly(trained: tuple) -> None:
    _, c, _, adapter, _ = trained
    ids = _prompts(1, 32, seed=9)[0]
    with torch.inference_mode():
        before = c(input_ids=ids).logits
        with adapter.applied(c):
            on = c(input_ids=ids).logits
        after = c(input_ids=ids).logits
    assert not torch.allclose(on, before, atol=1e-4)  # the trained adapter does change the consumer
    assert torch.equal(after, before)
    assert all(not p.requires_grad or p.grad is None for p in c.parameters())  # the consumer stayed frozen


def test_adapter_lowers_the_kl_on_the_transferred_cache(trained: tuple) -> None:
    _, c, _, adapter, transfer = trained

    def kl(on: bool) -> float:
        tot = 0.0
        for ids in _prompts(4):
            cut = ids.shape[1] - 8
            with torch.inference_mode():
                ref = c(input_ids=ids).logits[0, cut:]
                keys, values = transfer(ids[:, :cut])
                if on:
                    with adapter.applied(c):
                        got = suffix_logits(c, keys, values, ids, cut)
                else:
                    got = suffix_logits(c, keys, values, ids, cut)
            tot += float(kl_div(ref, got))
        return tot

    assert kl(True) < 0.8 * kl(False)


def test_adapter_for_another_pair_is_refused(trained: tuple, tmp_path: Path) -> None:
    p, c, codec, adapter, _ = trained
    adapter.check(codec.producer_fp, codec.consumer_fp, codec.pair.hex())
    with pytest.raises(AdapterError, match="another codec"):
        adapter.check(codec.producer_fp, codec.consumer_fp, "ab" * 32)
    with pytest.raises(AdapterError, match="another consumer"), adapter.applied(p, consumer_fp=model_fingerprint(p)):
        pass
    path = adapter.save(tmp_path / "adapter.safetensors")
    back = Adapter.load(path)
    assert back.identity() == adapter.identity() and all(torch.equal(back.tensors[k], v)
                                                          for k, v in adapter.tensors.items())
    wide = tiny_model("qwen3", seed=0, hidden_size=96)
    with pytest.raises(AdapterError, match="mis-shaped"), lora(wide, adapter.tensors, adapter.config):
        pass
    assert set(init_tensors(c, adapter.config)) == set(adapter.tensors)
    with pytest.raises(AdapterError, match="targets"):
        AdapterConfig(targets=("k_proj",))
