"""The routing probe: every ranker reading every page is full attention; scores and masses match brute force;
the metadata charge costs pages; a test seed is refused."""

import copy

import pytest
import torch
from transformers import DynamicCache

from kvstate.lab.semantic import real_routing as R
from kvstate.lab.semantic.methods.quest import PageStore
from kvstate.models import tiny_model

T, Q = 150, 5


def _ids(seed, n):
    return torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
@pytest.mark.parametrize("rank", R.RANKERS)
def test_reading_every_page_is_full_attention_and_a_small_budget_is_not(rank):
    from kvstate.semantic import semantic_attention

    model = tiny_model("qwen3")
    ids, q = _ids(0, T), _ids(1, Q)
    pre = DynamicCache(config=model.config)
    model(input_ids=ids, position_ids=torch.arange(T)[None], cache=pre)
    ref = model(input_ids=q, position_ids=torch.arange(T, T + Q)[None], cache=copy.deepcopy(pre)).logits

    def run(row, budget):
        cache = R.probe_cache(model, pre, row, budget=budget)
        with semantic_attention(model):
            out = model(input_ids=q, position_ids=torch.arange(T, T + Q)[None], cache=cache).logits
        return out, cache

    wide, cache = run(f"{rank}_free", 1.0)  # uncharged metadata: the whole budget reads every page
    assert (wide - ref).abs().max() < 1e-5
    assert all(abs(c - 1.0) < 1e-5 for layer in cache.semantic_layers for c in layer.store.captured)
    narrow, cache = run(rank, 0.4)
    assert (narrow - ref).abs().max() > 1e-4
    assert all(0.0 <= c < 1.0 for layer in cache.semantic_layers for c in layer.store.captured)


def _store(h=2, m=12, page=4, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(h, m, d, generator=g)
    vals = torch.randn(h, m, d, generator=g)
    anchor = torch.randn(1, h, 3, d, generator=g)
    pad = -m % page
    pages = torch.cat([keys, keys[:, -1:].expand(-1, pad, -1)], 1).view(h, -(-m // page), page, d)
    return PageStore(anchor, anchor.clone(), pages.amin(2), pages.amax(2), keys, vals, page, budget=1.0)


def test_page_scores_match_brute_force():
    store = _store()
    q = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(1))  # (H, g, D)
    scale = 0.5
    for rank in R.RANKERS:
        score, mass = R.page_scores(rank, q, store, scale)
        for h in range(2):
            allk = torch.cat([store.anchor_k[0, h], store.slow_k[h]])
            for gi in range(3):
                p = torch.softmax(allk @ q[h, gi] * scale, 0)[3:]
                for pg in range(3):
                    assert abs(float(mass[h, gi, pg]) - float(p[4 * pg:4 * pg + 4].sum())) < 1e-5
            for pg in range(3):
                keys = store.slow_k[h, 4 * pg:4 * pg + 4]
                if rank == "bound":  # Quest's bound: at least every logit of the page's keys, for every query
                    want = max(sum(max(float(q[h, gi, c] * keys[:, c].min()), float(q[h, gi, c] * keys[:, c].max()))
                                   for c in range(8)) for gi in range(3))
                    assert float(score[h, pg]) >= max(float((keys @ q[h, gi]).max()) for gi in range(3)) - 1e-5
                elif rank == "mean":
                    want = max(float(keys.mean(0) @ q[h, gi]) for gi in range(3))
                else:
                    want = max(float(mass[h, gi, pg]) for gi in range(3))
                assert abs(float(score[h, pg]) - want) < 1e-4
    with pytest.raises(ValueError, match="unknown ranker"):
        R.page_scores("nope", q, store, scale)


def test_the_metadata_charge_costs_pages():
    s = _store(m=64, page=4)
    kw = dict(anchor_k=s.anchor_k, anchor_v=s.anchor_v, page_min=s.page_min, page_max=s.page_max, slow_k=s.slow_k,
              slow_v=s.slow_v, page=4, budget=0.5)
    free = R.ProbeStore(**kw, rank="bound", charged=False)
    mean = R.ProbeStore(**kw, rank="mean")
    bound = R.ProbeStore(**kw, rank="bound")
    assert free.n_pages_now() > mean.n_pages_now() > bound.n_pages_now() >= 0
    token = s.token_bytes
    assert free.allowance() == (int(0.5 * s.full_nbytes()) - 2 * s.anchor_k.nbytes) // token
    assert bound.allowance() == (int(0.5 * s.full_nbytes()) - 2 * s.anchor_k.nbytes - 2 * s.page_min.nbytes) // token
    assert free.n_pages_now() == free.allowance() // 4  # whole pages of 4 tokens while they fit


def test_a_short_last_page_costs_only_its_tokens():
    s = _store(m=10, page=4)  # pages of 4, 4 and 2 tokens
    pages = s.slow_k.new_zeros(2, 3, 8)
    store = R.ProbeStore(s.anchor_k, s.anchor_v, pages, pages, s.slow_k, s.slow_v, 4, budget=1.0, charged=False)
    assert store.allowance() == 10 and store.n_pages_now() == 3
    assert store._pick(torch.tensor([[2, 0, 1]])) == [2, 0, 1]


def test_a_test_seed_is_refused_before_the_model_loads(capsys):
    assert R.main(["--seed", "1070", "--n", "1"]) == 2
    assert "is a test seed" in capsys.readouterr().err
