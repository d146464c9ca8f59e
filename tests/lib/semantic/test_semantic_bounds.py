"""Bounded routing: Quest's bound over a span's keys is never below any logit of the keys attention reads
back (raw, low-rank, quantized), and a span holding a key aligned with the query ranks first and is the
one expanded — where the untrained learned relevance ranks it elsewhere."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstate.semantic.bounds import upper_bound
from kvstate.semantic.router import RouterConfig, SemanticRouter
from kvstate.semantic.segment import Segmentation
from kvstate.semantic.store import SpanStore
from tests.semantic_util import lowrank_config

H, D = 2, 16


def _store(keys, values, spans, config, n_heads=H):
    t = keys.shape[2]
    seg = Segmentation(t, np.zeros(0, dtype=np.int64), np.array(spans, dtype=np.int64).reshape(-1, 2))
    router = SemanticRouter(RouterConfig(n_layers=1, n_heads=n_heads, n_kv_heads=keys.shape[1], head_dim=keys.shape[3]))
    weights = [np.full(b - a, 1.0 / (b - a)) for a, b in spans]
    return SpanStore.build(keys, values, seg, weights, router, 0, config), router


SLOW = [{"slow": "raw"}, {"slow": "lowrank", "rank": 2}, {"slow": "quant", "bits": 2, "outliers": 0.0},
        {"slow": "quant", "bits": 4}, {"slow": "quant", "bits": 8}]


@pytest.mark.parametrize("slow", SLOW, ids=lambda k: "-".join(map(str, k.values())))
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(2, 12), spans=st.integers(1, 4), scale=st.floats(0.1, 20.0))
def test_bound_is_at_least_every_logit_of_the_keys_read_back(slow, seed, n, spans, scale):
    g = torch.Generator().manual_seed(seed)
    t = n * spans
    keys = scale * torch.randn(1, H, t, D, generator=g) + torch.randn(1, H, 1, D, generator=g)
    values = torch.randn(1, H, t, D, generator=g)
    store, _ = _store(keys, values, [(i * n, (i + 1) * n) for i in range(spans)], lowrank_config(**slow))
    q = scale * torch.randn(H, 5, D, generator=g)  # (H, M, D) query rows per KV head
    bound = upper_bound(q, store.k_lo, store.k_hi)  # (H, M, S)
    for s in range(spans):
        k = store._keys_of(s, torch.float32)  # (H, n, D) exactly what attention would read
        logits = (q @ k.transpose(-1, -2)).amax(-1)  # (H, M)
        assert (bound[:, :, s] >= logits - 1e-5 * (1 + logits.abs())).all()


def _needle_keys(seed=0, n=8, spans=10, needle=6):
    """Spans of random keys; span ``needle`` holds one key along ``q`` among keys pointing away from it, so its
    mean key is unremarkable while one of its logits is the largest of the context."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(D, generator=g)
    q = q / q.norm()
    keys = torch.randn(1, H, n * spans, D, generator=g)
    a = needle * n
    keys[0, :, a:a + n] -= 2.5 * q  # the needle span's other keys lean away from the query
    keys[0, :, a + 3] = 12.0 * q  # the needle: a logit of 12 where random spans bound about 5
    return keys, q, [(i * n, (i + 1) * n) for i in range(spans)]


def _expanded(store, query, router, cfg):
    """The spans one pass reconstructs with room for one span."""
    seen = []
    recon = store._reconstruct
    store._reconstruct = lambda chosen, *a: seen.append(chosen) or recon(chosen, *a)
    store.allowance = lambda budget: 8 * store.token_bytes
    store.attend(query, 1.0, router, 0, cfg)
    return seen


def test_the_span_holding_a_needle_ranks_first_under_bounds_and_is_expanded():
    keys, q, spans = _needle_keys()
    values = torch.randn(keys.shape, generator=torch.Generator().manual_seed(1))
    query = q.expand(1, 2 * H, 1, D).contiguous()  # (1, Hq, 1, D): a GQA group of two heads per KV head
    for slow in ({"slow": "quant", "bits": 4, "outliers": 0.0}, {"slow": "raw"}):
        cfg = lowrank_config(budget=0.9, sticky=False, **slow)
        store, router = _store(keys, values, spans, cfg, n_heads=2 * H)
        want, score = store.decide(query[0], 1.0, router, 0, cfg)
        assert want.all() and score.amax(0).argmax() == 6
        mean_rank = int((store.sum_k[0] @ q).amax(0).argsort(descending=True).tolist().index(6))
        assert mean_rank > 0  # the mean key alone would not find it
        assert _expanded(store, query, router, cfg) == [(6,)]


def test_learned_routing_of_an_untrained_router_ranks_the_needle_span_elsewhere():
    """The ablation: the paper's learned relevance (untrained here) scores the same spans by a projected,
    weighted mean key and does not rank the needle's span first."""
    keys, q, spans = _needle_keys()
    cfg = lowrank_config(budget=0.9, routing="learned", sticky=False)
    store, router = _store(keys, torch.zeros_like(keys), spans, cfg, n_heads=2 * H)
    _, score = store.decide(q.expand(2 * H, 1, D), 1.0, router, 0, cfg)
    order = score.amax(0).argsort(descending=True).tolist()
    assert order.index(6) > 0
    assert store.k_lo is None and store.route.shape[-1] > 0  # learned routing keeps summaries, not bounds


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 12), r=st.integers(1, 6), scale=st.floats(0.1, 20.0))
def test_the_bound_in_rank_coordinates_is_at_least_every_logit_of_the_reconstructed_keys(seed, n, r, scale):
    from kvstate.semantic.bounds import rank_bounds, rank_upper_bound

    g = torch.Generator().manual_seed(seed)
    a = scale * torch.randn(H, n, r, generator=g)  # (H, n, r) coordinates
    b = torch.randn(H, r, D, generator=g)  # (H, r, D) basis
    q = scale * torch.randn(H, 5, D, generator=g)
    lo, hi = rank_bounds(a)
    bound = rank_upper_bound(q, b, lo, hi)  # (H, M)
    logits = (q @ (a @ b).transpose(-1, -2)).amax(-1)  # (H, M): the largest logit of the keys read back
    assert (bound >= logits - 1e-4 * (1 + logits.abs())).all()
    if n == 1:  # one key: the box is a point and the bound is its logit
        assert torch.allclose(bound, logits, rtol=1e-4, atol=1e-3)
