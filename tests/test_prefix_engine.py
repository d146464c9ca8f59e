"""SparsePrefixCache against full recomputation, on tiny models of every kind of state."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstate.errors import BudgetError, KVStateError
from kvstate.models import checkpoint_bytes, segmented_prefill, tiny_model
from kvstate.prefix.engine import SparsePrefixCache
from tests.conftest import get_model, random_ids

MiB = 1 << 20


def _full(model, ids):
    return segmented_prefill(model, ids).logits


@pytest.mark.parametrize("family", ["qwen3_5", "mamba2", "bamba", "falcon_h1", "qwen3"])
def test_resume_matches_full_recompute_and_reuses(family):
    model = get_model(family)
    cache = SparsePrefixCache(model, budget_bytes=64 * MiB, slots_per_entry=4, align=8)
    doc = random_ids(96, seed=1)
    first = cache.prefill(torch.cat([doc, random_ids(8, seed=2)], 1))
    assert first.reused_tokens == 0 and first.recomputed_tokens == 104
    ids = torch.cat([doc, random_ids(12, seed=3)], 1)
    res = cache.prefill(ids)
    assert res.reused_tokens > 0 and res.reused_tokens + res.recomputed_tokens == ids.shape[1]
    assert res.new_tokens == 12
    torch.testing.assert_close(res.logits, _full(model, ids), atol=1e-4, rtol=0)
    if family == "qwen3":  # attention-only: KV is valid at every position
        assert res.reused_tokens == 96 and res.lost_tokens == 0


@pytest.mark.parametrize("family", ["qwen3_5", "bamba"])
def test_bf16_resume_is_bit_identical_at_chunk_aligned_checkpoints(family):
    model = tiny_model(family, dtype=torch.bfloat16)
    model.set_attn_implementation("eager")  # SDPA depends on query length (see docs)
    cache = SparsePrefixCache(model, budget_bytes=64 * MiB, slots_per_entry=2)  # align = chunk size
    chunk = cache.align
    doc = random_ids(chunk * 2 + 10, seed=4)
    cache.prefill(doc)
    ids = torch.cat([doc[:, : chunk * 2 + 5], random_ids(7, seed=5)], 1)
    res = cache.prefill(ids)
    assert res.reused_tokens % chunk == 0 and res.reused_tokens > 0
    n = ids.shape[1]
    # the cached path equals the same segmented computation (calls end at the checkpoint and at n-1) bit for bit
    same = segmented_prefill(model, ids, cuts=[res.reused_tokens, n - 1]).logits
    assert torch.equal(res.logits, same)
    if family == "qwen3_5":
        # Gated DeltaNet: the 1-token last call rounds like the chunked kernel, so one-shot agrees too.
        # (Mamba2's 1-token call takes the recurrent step path and differs by a bf16 ulp; see docs.)
        assert torch.equal(res.logits, segmented_prefill(model, ids).logits)


def test_full_hit_needs_no_compute_and_generate_continues_exactly():
    model = get_model("qwen3_5")
    cache = SparsePrefixCache(model, budget_bytes=64 * MiB, align=8)
    ids = random_ids(40, seed=6)
    cache.prefill(ids)
    res = cache.prefill(ids)
    assert res.recomputed_tokens == 0 and res.reused_tokens == 40
    scratch = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    resumed = model.generate(ids, cache=res.cache, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(resumed, scratch)


def test_generate_from_a_partial_hit_equals_scratch():
    model = get_model("bamba")
    cache = SparsePrefixCache(model, budget_bytes=64 * MiB, align=8)
    doc = random_ids(64, seed=7)
    cache.prefill(doc)
    ids = torch.cat([doc[:, :50], random_ids(6, seed=8)], 1)
    res = cache.prefill(ids)
    assert res.reused_tokens > 0
    scratch = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    resumed = model.generate(ids, cache=res.cache, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(resumed, scratch)


def test_no_attention_hit_past_the_usable_checkpoint_and_lost_tokens_counted():
    model = get_model("qwen3_5")
    cache = SparsePrefixCache(model, budget_bytes=64 * MiB, slots_per_entry=1, align=16, planner="balanced")
    doc = random_ids(64, seed=9)
    cache.prefill(doc)
    entry = cache.store.entries()[0]
    ids = torch.cat([doc[:, :60], random_ids(4, seed=10)], 1)
    hit = cache.lookup(ids)
    assert hit is not None and hit.overlap == 60
    assert hit.position in entry.checkpoints and hit.position <= 60
    assert hit.lost == 60 - hit.position
    res = cache.prefill(ids)
    assert res.lost_tokens == hit.lost
    assert cache.metrics.tokens_lost_to_missing_checkpoint == hit.lost
    torch.testing.assert_close(res.logits, _full(model, ids), atol=1e-4, rtol=0)


def test_budget_smaller_than_one_checkpoint_says_how_many_bytes():
    model = get_model("qwen3_5")
    need = checkpoint_bytes(model.config)
    with pytest.raises(BudgetError, match=f"{need:,} bytes"):
        SparsePrefixCache(model, budget_bytes=need - 1)


def test_bad_arguments():
    model = get_model("qwen3_5")
    with pytest.raises(KVStateError, match="planner"):
        SparsePrefixCache(model, budget_bytes=MiB, planner="nope")
    with pytest.raises(KVStateError, match="policy"):
        SparsePrefixCache(model, budget_bytes=MiB, policy="fifo")
    with pytest.raises(KVStateError, match="one non-empty sequence"):
        SparsePrefixCache(model, budget_bytes=MiB).prefill(random_ids(4, batch=2))


def test_append_only_chat_keeps_one_entry():
    model = get_model("qwen3_5")
    cache = SparsePrefixCache(model, budget_bytes=64 * MiB, align=8)
    convo = random_ids(20, seed=11)
    prev_len = 0
    for turn in range(4):
        res = cache.prefill(convo)
        if turn:  # the last state suffices (kept after L-1 tokens: generate feeds the last one)
            assert res.reused_tokens == prev_len - 1
        prev_len = convo.shape[1]
        convo = torch.cat([convo, random_ids(10, seed=20 + turn)], 1)
    assert len(cache.store) == 1


def test_concurrent_prefills_are_exact():
    model = get_model("qwen3_5")
    cache = SparsePrefixCache(model, budget_bytes=64 * MiB, align=8)
    doc = random_ids(48, seed=12)
    reqs = [torch.cat([doc, random_ids(5, seed=30 + i)], 1) for i in range(6)]
    results: dict[int, torch.Tensor] = {}

    def work(i):
        results[i] = cache.prefill(reqs[i]).logits

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, r in enumerate(reqs):
        torch.testing.assert_close(results[i], _full(model, r), atol=1e-4, rtol=0)
    assert cache.metrics.hits >= 5


@pytest.mark.parametrize("policy", ["lru", "utility"])
@settings(max_examples=12, deadline=None)
@given(ops=st.lists(st.tuples(st.integers(0, 3), st.integers(4, 40), st.integers(1, 12)), min_size=2, max_size=7))
def test_random_operations_keep_budget_and_every_hit_exact(policy, ops):
    model = get_model("qwen3_5")
    ck = checkpoint_bytes(model.config)
    budget = 6 * ck  # a few entries' worth: forces evictions
    cache = SparsePrefixCache(model, budget_bytes=budget, slots_per_entry=3, align=4, policy=policy)
    docs = [random_ids(48, seed=100 + d) for d in range(4)]
    for doc_id, overlap, extra in ops:
        ids = torch.cat([docs[doc_id][:, :overlap], random_ids(extra, seed=overlap * 13 + extra)], 1)
        res = cache.prefill(ids)
        assert cache.store.used_bytes <= budget
        torch.testing.assert_close(res.logits, _full(model, ids), atol=1e-4, rtol=0)
        for e in cache.store.entries():  # nothing half-inserted: every checkpoint lies inside its entry
            assert all(0 < p < e.length for p in e.checkpoints)


def test_drift_replans_and_captures_pending_positions():
    model = get_model("qwen3_5")
    cache = SparsePrefixCache(model, budget_bytes=64 * MiB, slots_per_entry=2, align=4, drift_threshold=0.05)
    doc = random_ids(80, seed=13)
    cache.prefill(doc)
    before = list(cache.store.entries()[0].planned)
    for i in range(6):  # every request overlaps exactly 37 tokens
        cache.prefill(torch.cat([doc[:, :37], random_ids(3, seed=50 + i)], 1))
    entry = next(e for e in cache.store.entries() if e.length == 80)
    assert cache.metrics.replans >= 1 and entry.planned != before
    assert 36 in entry.planned  # the deepest grid point <= 37 is now planned
    assert 36 in entry.checkpoints  # ... and was captured by a later request


def test_a_model_whose_cache_cannot_be_snapshotted_is_refused():
    import transformers as tf

    from kvstate.errors import UnsupportedModelError

    gpt2 = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(UnsupportedModelError, match="supported families"):
        SparsePrefixCache(gpt2, budget_bytes=MiB)


def test_store_bytes_by_kind_add_up():
    model = get_model("bamba")
    cache = SparsePrefixCache(model, budget_bytes=64 * MiB, slots_per_entry=2, align=8)
    cache.prefill(random_ids(50, seed=40))
    kinds = cache.store.bytes_by_kind()
    assert sum(kinds.values()) == cache.store.used_bytes
    assert kinds["attention_kv"] == 50 * cache.store.config.kv_bytes_per_token
    entry = cache.store.entries()[0]  # the accounting is that of the tensors actually held
    assert entry.kv.nbytes == kinds["attention_kv"] and entry.final.nbytes == kinds["final_states"]
    assert all(c.nbytes == cache.store.config.checkpoint_bytes for c in entry.checkpoints.values())
    assert kinds["final_states"] == cache.store.config.checkpoint_bytes
    assert kinds["checkpoints"] == len(cache.store.entries()[0].checkpoints) * cache.store.config.checkpoint_bytes > 0
