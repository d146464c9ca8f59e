"""The throughput probe: every row timed `repeats` times, token rates computed from the timed seconds, and the
fine-tuning step timed in fp32 and under bf16 autocast, interleaved (a tiny Llama)."""

from __future__ import annotations

import pytest
import torch

from kvstate.lab.models.throughput import measure
from kvstate.models.tiny import tiny_model


def test_every_row_is_timed_per_repeat_and_both_fine_tuning_dtypes_are_measured():
    model = tiny_model("llama", seed=1, num_hidden_layers=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    seen: list[str] = []
    got = measure(model, [16, 32], decode_tokens=3, repeats=3, train_length=16, progress=seen.append)
    assert [r["length"] for r in got["prefill"]] == [16, 32] and [r["context"] for r in got["decode"]] == [16, 32]
    for row, tokens in [(got["prefill"][1], 32), (got["decode"][0], 3), (got["train"], 16),
                        (got["train_bf16_autocast"], 16)]:
        assert len(row["seconds"]) == 3
        lo, hi = row["tok_s_range"]
        assert lo <= row["tok_s"] <= hi  # the median of the repeats' rates, inside their range
        # the rates come from the timed seconds (stored to 4 decimals: compared where that rounding is small)
        if min(row["seconds"]) >= 0.01:
            rates = sorted(tokens / s for s in row["seconds"])
            assert row["tok_s"] == pytest.approx(rates[1], rel=0.02) and [lo, hi] == pytest.approx(
                [rates[0], rates[-1]], rel=0.02)
    assert sum("bf16 autocast" in m for m in seen) == 3
    assert not model.training  # left in eval mode
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())  # the steps did update it
