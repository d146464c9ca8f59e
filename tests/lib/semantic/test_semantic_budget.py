"""SEKV under its budgets: byte counts equal the tensors held and read, reads stay within the budget while
decoding folds tokens into new spans, the working set evicts the least relevant span, the slow tier
allocates ranks under its own budget (brute force on small inputs) and is exact at full rank."""

import itertools

import numpy as np
import pytest
import torch
from transformers import DynamicCache

from kvstate.errors import BudgetError
from kvstate.models import tiny_model
from kvstate.semantic import (
    SegmentConfig,
    SemanticCache,
    prefill_and_compress,
    semantic_attention,
)
from kvstate.semantic.ranks import allocate_ranks
from kvstate.semantic.store import SpanStore
from tests.semantic_util import lowrank_config

T = 160
SEG = SegmentConfig(sinks=2, recent=4, min_span=2, max_span=8)


def _ids(seed, n, vocab=128):
    return torch.randint(3, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _decode(model, cache, steps, seed=6, start=T):
    with semantic_attention(model):
        for t, tok in enumerate(_ids(seed, steps)[0]):
            model(input_ids=tok.view(1, 1), cache=cache, position_ids=torch.tensor([[start + t]]))


def test_byte_counts_equal_the_tensors_held_and_read(monkeypatch):
    model = tiny_model("qwen3")
    cache = SemanticCache(model, config=lowrank_config(budget=0.5, segment=SEG, zoom="similarity"))
    prefill_and_compress(model, cache, _ids(1, T))
    passes: dict[int, list[int]] = {}  # layer -> bytes read per pass, from the tensors themselves
    attend, recon = SpanStore.attend, SpanStore._reconstruct

    def spy_attend(self, *a, **k):
        self._spy = sum(t.nbytes for t in (self.anchor_k, self.anchor_v, self.sum_k, self.sum_v))
        out = attend(self, *a, **k)
        passes.setdefault(id(self), []).append(self._spy)
        return out

    def spy_recon(self, *a, **k):
        rk, rv, owner = recon(self, *a, **k)
        self._spy += rk.nbytes + rv.nbytes
        return rk, rv, owner

    monkeypatch.setattr(SpanStore, "attend", spy_attend)
    monkeypatch.setattr(SpanStore, "_reconstruct", spy_recon)
    _decode(model, cache, 12)
    stores = [layer.store for layer in cache.semantic_layers]
    b = cache.byte_counts()
    fast = sum(t.nbytes for st in stores for t in (st.anchor_k, st.anchor_v, st.sum_k, st.sum_v, st.route, st.log_n))
    working = sum(x.nbytes for st in stores for pair in st._working.values() for x in pair)
    slow = sum(x.nbytes for st in stores for pair in st.slow for lr in pair for x in (lr.a, lr.b))
    token = 2 * stores[0].anchor_k.shape[1] * stores[0].anchor_k.shape[3] * 4
    assert working > 0 and slow > 0  # something was expanded and offloaded
    assert b.resident_bytes == fast + working
    assert b.total_bytes == fast + working + slow
    per_pass = [sum(x) for x in zip(*passes.values(), strict=True)]
    assert len(per_pass) == 12 and b.attended_bytes_peak == max(per_pass)
    assert b.full_bytes == len(stores) * (T + 12) * token


@pytest.mark.parametrize("zoom,sticky", [("similarity", False), ("routed", True), ("similarity", True)])
def test_reads_never_exceed_the_budget_while_decoding_folds_tokens_into_spans(zoom, sticky):
    model = tiny_model("qwen3")
    budget = 0.55
    routing = "learned" if zoom == "routed" else "bounds"
    cache = SemanticCache(model, config=lowrank_config(budget=budget, segment=SEG, zoom=zoom, sticky=sticky,
                                                       routing=routing))
    if zoom == "routed":  # an untrained router expanding every span: only the cap limits it
        with torch.no_grad():
            cache.router.beta.fill_(10.0)
    prefill_and_compress(model, cache, _ids(3, T))
    spans0 = cache.semantic_layers[0].store.n_spans
    _decode(model, cache, 40)
    ratios = cache.read_ratios()
    assert len(ratios) == 40 and max(ratios) <= budget
    assert cache.semantic_layers[0].store.n_spans > spans0  # decoded tokens were folded into spans
    assert cache.expanded_fraction() > 0.05  # the cap left room to expand
    b = cache.byte_counts()
    assert b.attended_bytes_peak <= budget * b.full_bytes and b.resident_bytes <= budget * b.full_bytes


def test_uncapped_oracle_reads_past_the_budget():
    """The cap is what keeps reads in budget: the "all" oracle at the same budget reads more."""
    model = tiny_model("qwen3")
    cache = SemanticCache(model, config=lowrank_config(budget=0.35, segment=SEG, zoom="all"))
    prefill_and_compress(model, cache, _ids(3, T))
    _decode(model, cache, 5)
    assert max(cache.read_ratios()) > 0.9


def test_working_set_evicts_the_least_relevant_span():
    h, d = 1, 4
    st = SpanStore(torch.zeros(1, h, 2, d), torch.zeros(1, h, 2, d), torch.zeros(1, h, 3, d), torch.zeros(1, h, 3, d),
                   torch.zeros(h, 3, 2), torch.zeros(3), sizes=[4, 4, 4])
    want = torch.tensor([[True, True, True]])
    score = torch.tensor([[0.5, 2.0, 1.0]])
    tb = st.token_bytes
    assert st.select(want, score, 8 * tb).tolist() == [False, True, True]  # two spans fit: the least relevant goes
    assert st.select(want, score, 12 * tb).tolist() == [True, True, True]
    assert st.select(want, score, 3 * tb).tolist() == [False, False, False]
    assert st.select(want, score, None).tolist() == [True, True, True]


@pytest.mark.parametrize("route_query,expanded", [(None, (1,)), ("last", (1,)), ("all", (0,))])
def test_a_multi_token_pass_ranks_spans_by_its_last_query_by_default(route_query, expanded):
    """Room for one span: the question's last token wants span 1, an earlier token span 0 more strongly."""
    from kvstate.semantic.lowrank import Raw

    h, d = 1, 4
    e = torch.eye(d)
    st = SpanStore(torch.zeros(1, h, 2, d), torch.zeros(1, h, 2, d), e[None, None, :2], torch.zeros(1, h, 2, d),
                   torch.zeros(h, 2, 2), torch.zeros(2), sizes=[4, 4],
                   slow=[(Raw(torch.zeros(h, 4, d)), Raw(torch.zeros(h, 4, d))) for _ in range(2)])
    kw = {} if route_query is None else {"route_query": route_query}
    config = lowrank_config(budget=0.9, zoom="similarity", sticky=False, **kw)
    assert 4 * st.token_bytes <= st.allowance(config.budget) < 8 * st.token_bytes  # one span fits, not two
    query = torch.stack([5 * e[0], e[1]])[None, None]  # (1, Hq, Tq=2, D): token 0 -> span 0, last token -> span 1
    seen = []
    recon = st._reconstruct
    st._reconstruct = lambda chosen, *a: seen.append(chosen) or recon(chosen, *a)
    st.attend(query, 1.0, None, 0, config)
    assert seen == [expanded]
    assert st._joined is None and st.working_nbytes() == 0  # not sticky: expanded for the pass, then dropped


def _brute(gains, costs, caps, budget):
    best, arg = -1.0, None
    for ranks in itertools.product(*[range(1, c + 1) for c in caps]):
        if sum(r * c for r, c in zip(ranks, costs, strict=True)) <= budget:
            v = sum(g[:r].sum() for g, r in zip(gains, ranks, strict=True))
            if v > best:
                best, arg = v, ranks
    return best, arg


@pytest.mark.parametrize("seed", range(12))
def test_rank_allocation_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 4))
    gains = [np.sort(rng.random(5) ** 2)[::-1] for _ in range(n)]
    costs = [int(c) for c in rng.integers(1, 3, n)]  # equal costs within a span; ties resolved greedily
    caps = [int(c) for c in rng.integers(1, 6, n)]
    budget = int(rng.integers(sum(costs), sum(c * k for c, k in zip(costs, caps, strict=True)) + 2))
    got = allocate_ranks(gains, costs, caps, budget)
    best, _ = _brute(gains, costs, caps, budget)
    assert sum(int(r) * c for r, c in zip(got, costs, strict=True)) <= budget
    assert all(1 <= r <= k for r, k in zip(got, caps, strict=True))
    if len(set(costs)) == 1:  # equal costs: the greedy choice is optimal
        assert abs(sum(g[:r].sum() for g, r in zip(gains, got, strict=True)) - best) < 1e-9
    with pytest.raises(ValueError, match=f"minimum is {sum(costs)} bytes"):
        allocate_ranks(gains, costs, caps, sum(costs) - 1)


def test_slow_budget_is_shared_by_relative_energy_so_large_keys_do_not_take_it_all():
    """Keys ten times larger than values with the same spectra get the same ranks (absolute energy would give
    the keys every rank above 1); the budget still binds."""
    from kvstate.semantic.router import RouterConfig, SemanticRouter
    from kvstate.semantic.segment import Segmentation

    g = torch.Generator().manual_seed(0)
    h, t, d = 2, 96, 16
    basis = torch.randn(h, t, 4, generator=g) @ torch.randn(h, 4, d, generator=g)  # rank-4 structure
    values = (basis + 0.3 * torch.randn(h, t, d, generator=g))[None]
    keys = 10 * values
    spans = np.array([[a, a + 24] for a in range(0, t, 24)], dtype=np.int64)
    seg = Segmentation(t, np.zeros(0, dtype=np.int64), spans)
    router = SemanticRouter(RouterConfig(n_layers=1, n_heads=h, n_kv_heads=h, head_dim=d))
    cfg = lowrank_config(budget=0.5, slow_budget=0.2, max_rank=16)
    st = SpanStore.build(keys, values, seg, [np.full(24, 1 / 24)] * len(spans), router, 0, cfg)
    ranks = [(k.rank, v.rank) for k, v in st.slow]
    assert all(abs(rk - rv) <= 1 for rk, rv in ranks), ranks  # equal but for ties broken towards the keys
    assert sum(rk + rv for rk, rv in ranks) > 2 * len(ranks)  # the budget buys more than rank 1
    assert st.slow_nbytes() <= 0.2 * st.raw_span_bytes


def test_slow_tier_at_its_budget_is_smaller_than_raw_and_exact_at_full_rank():
    model = tiny_model("qwen3")
    ids, q = _ids(4, T), _ids(5, 6)
    seg = SegmentConfig(sinks=2, recent=8, min_span=2, max_span=32)
    cache = SemanticCache(model, config=lowrank_config(budget=0.6, segment=seg, slow_budget=0.25, max_rank=64))
    prefill_and_compress(model, cache, ids)
    st = cache.slow_tier()
    assert st["slow_bytes"] <= st["budget_bytes"] < st["raw_span_bytes"]
    assert sum(st["rank_histogram"].values()) == sum(st["cap_histogram"].values()) == 2 * len(cache.semantic_layers) * len(cache.segmentation.spans)
    wide = SemanticCache(model, config=lowrank_config(budget=0.6, segment=seg, slow_budget=1.0, max_rank=64))
    prefill_and_compress(model, wide, ids)
    assert wide.slow_tier()["slow_bytes"] > st["slow_bytes"]  # a larger budget buys rank
    full = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, cache=full, position_ids=torch.arange(T)[None])
        ref = model(input_ids=q, cache=full, position_ids=torch.arange(T, T + 6)[None]).logits
    for cfg in (lowrank_config(budget=0.6, segment=seg, zoom="all", rank=64),
                lowrank_config(budget=0.6, segment=seg, zoom="all", slow="raw")):
        exact = SemanticCache(model, config=cfg)
        prefill_and_compress(model, exact, ids)
        with semantic_attention(model), torch.no_grad():
            out = model(input_ids=q, cache=exact, position_ids=torch.arange(T, T + 6)[None]).logits
        assert (out - ref).abs().max() < 1e-5
    raw = exact.slow_tier()
    assert raw["slow_bytes"] == raw["raw_span_bytes"]  # raw offload: rank = full, bytes = raw


def test_budget_errors_name_the_minimum():
    model = tiny_model("qwen3")
    tight = SemanticCache(model, config=lowrank_config(budget=0.2, segment=SEG))
    with pytest.raises(BudgetError, match=r"minimum is \d+ bytes per layer, budget >= 0\.\d+"):
        prefill_and_compress(model, tight, _ids(1, T))
    low = SemanticCache(model, config=lowrank_config(budget=0.6, segment=SEG, slow_budget=0.01))
    with pytest.raises(BudgetError, match=r"below one rank per span: the minimum is \d+ bytes.*slow_budget >= 0\.\d+"):
        prefill_and_compress(model, low, _ids(1, T))


@pytest.mark.parametrize("kw,field", [({"expand_share": 1.0}, "expand_share"), ({"expand_share": -0.1}, "expand_share"),
                                      ({"slow_budget": 0.0}, "slow_budget"), ({"slow_budget": True}, "slow_budget"),
                                      ({"max_rank": 0}, "max_rank"), ({"slow": "disk"}, "slow"), ({"routing": "nearest"}, "routing"), ({"bits": 3}, "bits"), ({"bits": True}, "bits"), ({"outliers": 1.0}, "outliers"), ({"memory": 0.1}, "memory"), ({"memory": 5.0}, "memory"),
                                      ({"zoom": "nearest"}, "zoom"), ({"route_query": "first"}, "route_query")])
def test_config_refuses_out_of_range_fields(kw, field):
    from kvstate.errors import KVStateError

    with pytest.raises(KVStateError, match=f"SemanticConfig.{field}"):
        lowrank_config(**kw)
