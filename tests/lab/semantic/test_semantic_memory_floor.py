"""The memory floor: every configuration that fits holds at most its memory, the 2-bit quantized tier cannot
reach 1/16 of an fp32 cache and names a minimum above it."""

import torch

from kvstate.lab.semantic.memory_floor import floors
from kvstate.models import tiny_model


def test_fitting_rows_hold_at_most_the_memory_and_two_bit_codes_cannot_reach_one_sixteenth():
    model = tiny_model("qwen3", head_dim=64, max_position_embeddings=2048)
    ids = torch.randint(3, 128, (1024,), generator=torch.Generator().manual_seed(0)).tolist()
    rows = floors(model, ids, 0.0625)
    assert all(r["total"] <= 0.0625 for r in rows if r["fits"])
    q2 = [r for r in rows if r["bits"] == 2]
    assert q2 and not any(r["fits"] for r in q2)
    assert all(next(iter(r["minimum"].values())) > 0.0625 for r in q2)
    assert any(r["fits"] for r in rows if r["slow"] == "lowrank")  # low rank reaches 16:1
