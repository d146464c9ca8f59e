"""sekv_zip: the reconstruction scores are the model's own attention (brute force through eager attention), the
allocation is the brute-force top-k within the bf16 cap, 16 bits with everything kept is the full cache, a
compressed cache holds no more than its budget of the bf16 context and attends over anchors + dequantized kept
tokens, and too small a budget is refused naming the minimum."""

import copy

import pytest
import torch
from transformers import DynamicCache

from kvstate.errors import BudgetError
from kvstate.lab.semantic import bf16
from kvstate.lab.semantic.methods import Context, Prefilled, get
from kvstate.lab.semantic.methods import sekv_zip as Z
from kvstate.models import tiny_model
from kvstate.semantic import SegmentConfig, semantic_attention

T, Q = 150, 5
SEG = SegmentConfig(sinks=2, recent=8)


class _Tok:
    def encode(self, text, add_special_tokens=False):
        return [5, 6, 7]


@pytest.fixture(scope="module")
def setup():
    model = tiny_model("qwen3")
    g = torch.Generator().manual_seed(0)
    ids, q = torch.randint(3, 128, (1, T), generator=g), torch.randint(3, 128, (1, Q), generator=g)
    pre = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, position_ids=torch.arange(T)[None], cache=pre)
    return model, ids[0].tolist(), q, pre


@torch.no_grad()
def test_scores_are_the_largest_attention_each_context_token_gets_while_reconstructing(setup, monkeypatch):
    model, ctx, _, pre = setup
    monkeypatch.setattr(Z, "CHUNK", 64)  # chunked: 153 queries in three calls
    got = Z.reconstruction_scores(model, _Tok(), ctx, pre)
    rec = torch.tensor([[5, 6, 7, *ctx]])
    old = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        out = model(input_ids=rec, position_ids=torch.arange(T, T + rec.shape[1])[None], cache=copy.deepcopy(pre),
                    output_attentions=True)
    finally:
        model.set_attn_implementation(old)
    h = model.config.num_key_value_heads
    assert sorted(got) == list(range(len(out.attentions)))
    for i, a in enumerate(out.attentions):  # (1, Hq, q, T + q)
        want = a[0, :, :, :T].reshape(h, -1, rec.shape[1], T).amax((1, 2))
        assert got[i].shape == (h, T) and (got[i] - want).abs().max() < 1e-5
    assert pre.get_seq_length() == T  # the prefill is left as it was


def test_allocation_is_the_brute_force_top_k_within_the_cap():
    g = torch.Generator().manual_seed(1)
    scores = [torch.rand(2, 40, generator=g) for _ in range(3)]
    free = [torch.rand(2, 40, generator=g) > 0.2 for _ in range(3)]
    d, kb, vb, e = 8, 4, 2, 2
    for cap in (0, 150, 1000, 3000, 10 ** 6):
        got = Z.allocate(scores, free, cap, d, kb, vb, e)
        flat = torch.cat([s.masked_fill(~f, float("-inf")).flatten() for s, f in zip(scores, free, strict=True)])
        order = flat.argsort(descending=True)
        best = 0
        for n in range(int(sum(int(f.sum()) for f in free)) + 1):  # the most top-ranked tokens whose bytes fit
            take = torch.zeros(flat.numel(), dtype=torch.bool)
            take[order[:n]] = True
            used = sum(Z.kept_nbytes(int(c), d, kb, vb, e) for m in take.split(80) for c in m.view(2, 40).sum(1))
            if used <= cap:
                best = n
        assert sum(int(m.sum()) for m in got) == best
        assert all(not (m & ~f).any() for m, f in zip(got, free, strict=True))  # anchors never ranked


def _build(name, model, ctx, pre, budget):
    m = get(name)
    return m, m.build(model, _Tok(), ctx, budget, Context(None, SEG), Prefilled(pre, torch.zeros(T)))


@torch.no_grad()
def test_everything_kept_at_16_bits_is_the_full_cache(setup):
    model, ctx, q, pre = setup
    ref = model(input_ids=q, position_ids=torch.arange(T, T + Q)[None], cache=copy.deepcopy(pre)).logits
    m, cache = _build("kvzip_local", model, ctx, pre, 1.0)
    assert all(sum(hd.n for hd in layer.store.heads) == (T - 10) * model.config.num_key_value_heads
               for layer in cache.semantic_layers)
    with semantic_attention(model):
        out = model(input_ids=q, position_ids=torch.arange(T, T + Q)[None], cache=m.fork(cache, 1.0, None)).logits
    assert (out - ref).abs().max() < 1e-4


@torch.no_grad()
def test_a_compressed_cache_holds_its_bf16_budget_and_attends_over_anchors_and_the_dequantized_kept(setup):
    model, ctx, q, pre = setup
    ref = model(input_ids=q, position_ids=torch.arange(T, T + Q)[None], cache=copy.deepcopy(pre)).logits
    for name, budget in (("sekv_zip", 0.3), ("sekv_zip_v2", 0.2), ("sekv_zip8", 0.3)):
        m, cache = _build(name, model, ctx, pre, budget)
        held = bf16.counts(cache)
        assert 0 < held.total_bytes <= budget * held.full_bytes and held.full_bytes == bf16.counts(pre).full_bytes
        kept = sum(hd.n for layer in cache.semantic_layers for hd in layer.store.heads)
        assert 0 < kept < (T - 10) * 2 * len(cache.semantic_layers)
        work = m.fork(cache, budget, None)
        with semantic_attention(model):
            out = model(input_ids=q, position_ids=torch.arange(T, T + Q)[None], cache=work).logits
        assert (out - ref).abs().max() > 1e-4
        after = bf16.counts(work)
        assert after.attended_bytes_peak == after.total_bytes  # a pass reads everything held
    st = cache.semantic_layers[0].store
    k, v, pad = st._kept(torch.float32)
    qq = torch.randn(1, 4, 1, st.anchor_k.shape[3], generator=torch.Generator().manual_seed(2))
    st2 = copy.deepcopy(st)
    st2.append(torch.randn(1, 2, 1, qq.shape[3]), torch.randn(1, 2, 1, qq.shape[3]))
    out = st2.attend(qq, 0.5)
    for head in range(4):
        kv = head // 2
        keys = torch.cat([k[kv][~pad[kv]], st2.anchor_k[0, kv]])
        vals = torch.cat([v[kv][~pad[kv]], st2.anchor_v[0, kv]])
        want = torch.softmax(keys @ qq[0, head, 0] * 0.5, 0) @ vals
        assert (out[0, head, 0] - want).abs().max() < 1e-5


def test_too_small_a_budget_is_refused_naming_the_minimum_and_zero_kept_attends_the_anchors(setup):
    model, ctx, q, pre = setup
    with pytest.raises(BudgetError, match=r"budget >= 0\.0667"):
        _build("sekv_zip", model, ctx, pre, 0.05)
    m, cache = _build("sekv_zip", model, ctx, pre, 10 / T)  # room for the anchors only
    assert all(hd.n == 0 for layer in cache.semantic_layers for hd in layer.store.heads)
    with torch.no_grad(), semantic_attention(model):
        out = model(input_ids=q, position_ids=torch.arange(T, T + Q)[None], cache=m.fork(cache, 0.1, None)).logits
    assert torch.isfinite(out).all()
