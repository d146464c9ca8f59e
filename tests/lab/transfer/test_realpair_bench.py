"""The real pair's bench parts on the 4-layer pair: DroidSpeak's budgeted block profile picks the block of lowest KL
and a model against itself loses nothing; the per-method summary averages what the items kept."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvstate.lab.harness import load_reference
from kvstate.lab.transfer.realpair_bench import block_size, droidspeak_label, profile_block, summary
from kvstate.transfer.codec import Codec
from kvstate.transfer.methods import MethodContext

REPO = Path(__file__).resolve().parents[3]


def test_budgets_name_their_block_sizes() -> None:
    assert [block_size(30, s) for s in (0.1, 0.25, 1.0)] == [3, 7, 30] and block_size(4, 0.1) == 1
    assert droidspeak_label(0.25) == "droidspeak@0.25"


@pytest.fixture(scope="module")
def pair():
    p, tok = load_reference(REPO / "models/ref-attn")
    c, _ = load_reference(REPO / "models/ref-attn-ft2")
    codec_dir = REPO / "models/codec-ref-attn-ft2"
    return p, c, tok, MethodContext(codec=Codec.load(codec_dir), codec_dir=codec_dir)


def test_the_profile_picks_the_lowest_kl_and_the_whole_stack_is_the_oracle(pair) -> None:
    p, c, tok, ctx = pair
    prompts = [torch.tensor([tok(" ".join(["the cat sat on the mat and the dog ran home"] * 4))["input_ids"]])]
    (a, b), kl = profile_block(p, c, prompts, ctx, 2)
    assert set(kl) == {"0:2", "1:3", "2:4"} and kl[f"{a}:{b}"] == min(kl.values()) and b - a == 2
    # a model against itself: whatever is recomputed, only the fp16 wire rounding is left
    _, same = profile_block(p, p, prompts, ctx, 4)
    assert same["0:4"] < 1e-3 < min(kl.values())


def test_the_summary_averages_each_methods_record() -> None:
    rec = {"bytes_per_token": 10.0, "bf16_share": 0.5, "recomputed": 3, "flops_share": 0.1, "seconds": 1.0}
    got = summary([{"extra": {"methods": {"raw": rec}}}, {"extra": {"methods": {"raw": {**rec, "seconds": 3.0}}}}])
    assert got == {"raw": {**rec, "seconds": 2.0}}
