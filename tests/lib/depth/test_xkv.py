"""xKV (cross-layer SVD): the reconstruction is the brute-force truncated SVD of the group's stacked cache, the
bytes count the basis, and a cache of rank <= r comes back unchanged while a smaller rank changes the logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvstate.depth.xkv import XKVConfig, compress_cache, factor, rank_for
from kvstate.errors import KVStateError
from kvstate.lab.cached_reply import prefill
from kvstate.lab.harness import load_reference

TOY = Path(__file__).resolve().parents[3] / "models/ref-attn"


def test_rank_for_is_the_largest_rank_within_the_budget() -> None:
    for tokens, width, ratio in ((1024, 768, 0.5), (100, 64, 0.25), (7, 3000, 0.5)):
        r = rank_for(tokens, width, ratio)
        assert tokens * r + r * width <= ratio * tokens * width or r == 1
        assert tokens * (r + 1) + (r + 1) * width > ratio * tokens * width
    with pytest.raises(KVStateError, match="ratio"):
        XKVConfig(ratio=1.0)


def test_the_reconstruction_is_the_truncated_svd_of_each_groups_stack() -> None:
    model, tok = load_reference(TOY)
    ids = torch.tensor([tok(" ".join(["the cat sat on the mat and the dog ran to the red house"] * 3))["input_ids"]])
    cache = prefill(model, ids)
    before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    got = compress_cache(cache, XKVConfig(group=2, ratio=0.25))
    _, h, t, d = before[0][0].shape
    for g in range(0, len(before), 2):
        r = rank_for(t, 2 * h * d, 0.25)
        assert got.ranks[g // 2] == r
        for kind in (0, 1):
            x = torch.cat([before[j][kind][0].transpose(0, 1).reshape(t, h * d) for j in (g, g + 1)], dim=1).double()
            u, s, vh = torch.linalg.svd(x, full_matrices=False)
            want = (u[:, :r] * s[:r]) @ vh[:r]
            have = torch.cat([getattr(cache.layers[j], ("keys", "values")[kind])[0].transpose(0, 1).reshape(t, h * d)
                              for j in (g, g + 1)], dim=1).double()
            assert torch.allclose(have, want, atol=1e-4)
            assert (have - x).norm() > 1e-3  # rank r < the stack's rank: something was dropped
    n_full = sum(k.numel() + v.numel() for k, v in before) * 2
    assert got.bytes_full == n_full and got.bytes_held <= 0.25 * n_full + 1e-9 and got.ratio == got.bytes_held / n_full


def test_a_stack_of_rank_r_comes_back_exactly_and_the_logits_move_more_at_a_smaller_rank() -> None:
    g = torch.Generator().manual_seed(0)
    low = torch.randn(50, 3, generator=g) @ torch.randn(3, 40, generator=g)
    a, b = factor(low, 3)
    assert a.shape == (50, 3) and b.shape == (3, 40) and torch.allclose(a @ b, low, atol=1e-5)
    model, tok = load_reference(TOY)
    ids = torch.tensor([tok(" ".join(["the cat sat on the mat and the dog ran to the red house"] * 4))["input_ids"]])
    with torch.no_grad():
        ref = model(ids).logits[0, -1]

        def err(ratio: float) -> float:
            cache = prefill(model, ids)
            compress_cache(cache, XKVConfig(group=4, ratio=ratio))
            return float((model(ids[:, -1:], cache=cache, use_cache=True).logits[0, -1] - ref).abs().max())

        assert err(0.02) > 2 * err(0.6) and err(0.02) > 1e-2
