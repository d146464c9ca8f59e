"""Byte counts against a bf16 full cache (kvstate.lab.semantic.bf16), checked against counts by hand."""

import copy

import torch

from kvstate.lab.semantic import bf16, methods
from kvstate.lab.semantic.methods import Context
from kvstate.lab.semantic.methods.quest import PageStore
from kvstate.lab.semantic.methods.quest_quant import quantize_pages
from kvstate.models import tiny_model
from kvstate.semantic import SegmentConfig, semantic_attention
from kvstate.semantic.accounting import ByteCounts

H, A, P, PAGE, D = 2, 3, 4, 4, 8
M = P * PAGE


def _page_store():
    g = torch.Generator().manual_seed(0)
    mid_k, mid_v = torch.randn(H, M, D, generator=g), torch.randn(H, M, D, generator=g)
    padded = mid_k.view(H, P, PAGE, D)
    return PageStore(torch.randn(1, H, A, D, generator=g), torch.randn(1, H, A, D, generator=g), padded.amin(2),
                     padded.amax(2), mid_k, mid_v, PAGE, budget=1.0, top_k=2)


class _Layer:
    def __init__(self, store):
        self.store, self.keys, self.values = store, None, None


class _Cache:
    def __init__(self, *stores):
        self.semantic_layers = [_Layer(s) for s in stores]


def test_a_page_store_counts_every_floating_tensor_at_two_bytes():
    st = _page_store()
    st.attend(torch.randn(1, 2 * H, 1, D), 1.0)  # one pass of one token reads the anchors + 2 pages
    before = [t.clone() for t in (st.anchor_k, st.slow_k)]
    got = bf16.counts(_Cache(st, copy.copy(st)))
    fast = 2 * H * A * D * 2 + 2 * H * P * D * 2  # anchors K/V, page min / max
    slow = 2 * H * M * D * 2
    full = (A + M) * 2 * H * D * 2
    read = 2 * H * A * D * 2 + 2 * H * 2 * PAGE * D * 2 + 2 * H * P * D * 2  # anchors, 2 pages, the min / max read
    assert got == ByteCounts(2 * fast, 2 * (fast + slow), 2 * read, 2 * full), got
    assert st.reads == [2 * H * A * D * 4 + 2 * H * 2 * PAGE * D * 4]  # the bench's fp32 count, untouched
    assert torch.equal(st.anchor_k, before[0]) and st.slow_k.dtype == torch.float32 and torch.equal(st.slow_k, before[1])


def test_codes_count_as_held_and_their_ranges_at_two_bytes():
    for bits in (4, 2):
        st = quantize_pages(_page_store(), bits)
        got = bf16.counts(_Cache(st))
        codes = 2 * H * M * (D * bits // 8)  # key and value codes, packed
        ranges = H * M * 2 * 2  # each value token's lo / hi in bf16 (keys: the page min / max, in the fast tier)
        fast = 2 * H * A * D * 2 + 2 * H * P * D * 2
        assert got.total_bytes - got.resident_bytes == codes + ranges, (bits, got)
        assert got.resident_bytes == fast and got.full_bytes == (A + M) * 2 * H * D * 2


def test_full_cache_is_one_and_kivi_reads_what_it_holds():
    model = tiny_model("qwen3")
    ids = torch.randint(3, 128, (120,), generator=torch.Generator().manual_seed(1)).tolist()
    pre = methods.prefill(model, ids)
    full = methods.get("full").build(model, None, ids, 1.0, Context(None, SegmentConfig()), pre)
    kv32 = sum(layer.keys.nbytes + layer.values.nbytes for layer in full.layers)
    got = bf16.counts(full)
    assert got == ByteCounts(kv32 // 2, kv32 // 2, kv32 // 2, kv32 // 2)
    kivi = methods.get("kivi").build(model, None, ids, 0.25, Context(None, SegmentConfig(sinks=2, recent=8)), pre)
    with semantic_attention(model):
        model(input_ids=torch.tensor([[5, 6]]), position_ids=torch.arange(120, 122)[None], cache=kivi)
    b = bf16.counts(kivi)
    b32 = kivi.byte_counts()
    assert b.resident_bytes == b.total_bytes == b.attended_bytes_peak < b32.resident_bytes
    # by hand: codes as held, the float ranges and the exact residual at half their fp32 bytes
    codes = sum(c.nbytes for layer in kivi.semantic_layers for c, _, _ in layer.store.q_k) + \
        sum(v.codes.nbytes for layer in kivi.semantic_layers for v in layer.store.q_v)
    assert b.resident_bytes == codes + (b32.resident_bytes - codes) // 2
    assert b.full_bytes * 2 == b32.full_bytes
