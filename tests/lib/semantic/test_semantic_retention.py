"""Retention by context reconstruction x a quantized tier (kvstate.semantic.retention): the scores are the model's
own attention (brute force through eager attention), the allocation is the brute-force top-k within the bf16 cap,
16 bits with everything kept is the full cache, a compressed cache holds no more than its memory of the bf16
context (counted from its tensors) and attends over anchors + dequantized kept tokens, generate() runs on it, and
bad input (config, budget, scores, ids) is one error naming the fix."""

import copy

import pytest
import torch
from transformers import DynamicCache

from kvstate.errors import BudgetError, KVStateError
from kvstate.models import tiny_model
from kvstate.semantic import retention as Z
from kvstate.semantic import semantic_attention

T, Q = 150, 5


def _cfg(memory, bits=4, value_bits=None):
    return Z.RetentionConfig(memory=memory, bits=bits, value_bits=value_bits, sinks=2, recent=8)


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
def test_scores_are_the_largest_attention_each_context_token_gets_while_reconstructing(setup):
    model, ctx, _, pre = setup
    # chunked: 153 queries in three calls
    got = Z.reconstruction_scores(model, _Tok(), pre, ctx, chunk=64)
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


def _build(model, ctx, pre, cfg):
    cache = Z.RetainedCache(model, cfg)
    cache.adopt(pre)
    cache.compress(Z.reconstruction_scores(model, _Tok(), pre, ctx))
    return cache


def _bf16_held(cache) -> int:
    """Bytes of every tensor the compressed layers hold, floating ones counted at 2 bytes (bf16)."""
    total = 0
    for layer in cache.semantic_layers:
        for t in layer.store._tensors():
            total += t.numel() * 2 if t.is_floating_point() else t.nbytes
    return total


@torch.no_grad()
def test_everything_kept_at_16_bits_is_the_full_cache(setup):
    model, ctx, q, pre = setup
    ref = model(input_ids=q, position_ids=torch.arange(T, T + Q)[None], cache=copy.deepcopy(pre)).logits
    cache = _build(model, ctx, pre, _cfg(1.0, 16))
    assert all(sum(hd.n for hd in layer.store.heads) == (T - 10) * model.config.num_key_value_heads
               for layer in cache.semantic_layers)
    with semantic_attention(model):
        out = model(input_ids=q, position_ids=torch.arange(T, T + Q)[None], cache=cache.fork()).logits
    assert (out - ref).abs().max() < 1e-4


@torch.no_grad()
def test_a_compressed_cache_holds_its_bf16_budget_and_attends_over_anchors_and_the_dequantized_kept(setup):
    model, ctx, q, pre = setup
    ref = model(input_ids=q, position_ids=torch.arange(T, T + Q)[None], cache=copy.deepcopy(pre)).logits
    full_bf16 = sum((layer.keys.numel() + layer.values.numel()) * 2 for layer in pre.layers)
    for memory, bits, vbits in ((0.3, 4, None), (0.2, 4, 2), (0.3, 8, None)):
        cache = _build(model, ctx, pre, _cfg(memory, bits, vbits))
        assert 0 < _bf16_held(cache) <= memory * full_bf16
        kept = sum(hd.n for layer in cache.semantic_layers for hd in layer.store.heads)
        assert 0 < kept < (T - 10) * 2 * len(cache.semantic_layers)
        work = cache.fork()
        with semantic_attention(model):
            out = model(input_ids=q, position_ids=torch.arange(T, T + Q)[None], cache=work).logits
        assert (out - ref).abs().max() > 1e-4
        got = work.byte_counts()
        assert got.attended_bytes_peak == got.total_bytes  # a pass reads everything held
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
        _build(model, ctx, pre, _cfg(0.05))
    cache = _build(model, ctx, pre, _cfg(10 / T))  # room for the anchors only
    assert all(hd.n == 0 for layer in cache.semantic_layers for hd in layer.store.heads)
    with torch.no_grad(), semantic_attention(model):
        out = model(input_ids=q, position_ids=torch.arange(T, T + Q)[None], cache=cache.fork()).logits
    assert torch.isfinite(out).all()


@torch.no_grad()
def test_generate_runs_on_a_retained_cache_and_everything_kept_matches_the_full_cache(setup):
    model, ctx, q, _ = setup
    ids = torch.tensor([ctx])
    full_ids = torch.cat([ids, q], 1)
    ref = model.generate(full_ids, max_new_tokens=4, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, cache=DynamicCache(config=model.config))
    for cfg, close in ((_cfg(1.0, 16), True), (Z.RetentionConfig(memory=0.3), False)):
        cache = Z.retain(model, _Tok(), ids, cfg)
        with semantic_attention(model):
            out = model.generate(full_ids, max_new_tokens=4, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True, cache=cache)
        assert out.sequences.shape == (1, T + Q + 4)
        diff = max(float((a - b).abs().max()) for a, b in zip(ref.logits, out.logits, strict=True))
        assert (diff < 1e-4) == close
    assert model.config._attn_implementation != "sekv"


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"memory": 0.0}, "memory=0.0 must be in"), ({"memory": 1.5}, "must be in"), ({"bits": 3}, "bits=3; choose"),
    ({"value_bits": 5}, "value_bits=5"), ({"bits": 16, "value_bits": 4}, "set both to 16"),
    ({"recent": -1}, "must be >= 0"), ({"chunk": 0}, "chunk=0")])
def test_a_bad_config_is_one_error_naming_the_fix(kwargs, match):
    with pytest.raises(KVStateError, match=match):
        Z.RetentionConfig(**kwargs)


def test_bad_scores_ids_or_a_second_compress_are_refused(setup):
    model, ctx, _, pre = setup
    cache = Z.RetainedCache(model, _cfg(0.3))
    cache.adopt(pre)
    with pytest.raises(KVStateError, match="pass the per-layer token scores"):
        cache.compress(None)
    with pytest.raises(KVStateError, match=r"must be \(2, 150\) per layer"):
        cache.compress({layer.layer_idx: torch.zeros(2, 7) for layer in cache.semantic_layers})
    with pytest.raises(KVStateError, match="the cache holds 150 tokens, the context 3"):
        Z.reconstruction_scores(model, _Tok(), pre, ctx[:3])
    with pytest.raises(KVStateError, match=r"input_ids must be a \(1, T\) tensor"):
        Z.retain(model, _Tok(), torch.tensor(ctx))
    with pytest.raises(KVStateError, match="retention must be a RetentionConfig"):
        Z.RetainedCache(model, {"memory": 0.1})
    cache.compress(Z.reconstruction_scores(model, _Tok(), pre, ctx))
    with pytest.raises(KVStateError, match="already compressed"):
        cache.compress(Z.reconstruction_scores(model, _Tok(), pre, ctx))
