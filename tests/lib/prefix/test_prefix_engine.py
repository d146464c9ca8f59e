"""SparsePrefixCache against full recomputation, on tiny models of every kind of state."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstate.errors import BudgetError, KVStateError
from kvstate.models import checkpoint_bytes, restore_cache, segmented_prefill, tiny_model
from kvstate.prefix import PrefixCacheConfig
from kvstate.prefix.engine import SparsePrefixCache
from kvstate.prefix.segments import KVSegment
from tests.conftest import get_model, random_ids

MiB = 1 << 20


def _full(model, ids):
    return segmented_prefill(model, ids).logits


def _assert_generate_equal(model, ids, cache):
    """Greedy generation resumed from ``cache`` equals scratch on the scores (tolerance), then the tokens."""
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0, output_scores=True,
              return_dict_in_generate=True)
    kw["attention_mask"] = torch.ones_like(ids)  # random ids may hold the pad id 0: never mask them
    scratch, resumed = model.generate(ids, **kw), model.generate(ids, cache=cache, **kw)
    a, b = torch.stack(resumed.scores, 1), torch.stack(scratch.scores, 1)  # -inf where EOS is banned
    finite = torch.isfinite(b)
    assert torch.equal(torch.isfinite(a), finite) and float((a[finite] - b[finite]).abs().max()) < 1e-4
    assert torch.equal(resumed.sequences, scratch.sequences)


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
    _assert_generate_equal(model, ids, res.cache)


def test_generate_from_a_partial_hit_equals_scratch():
    model = get_model("bamba")
    cache = SparsePrefixCache(model, budget_bytes=64 * MiB, align=8)
    doc = random_ids(64, seed=7)
    cache.prefill(doc)
    ids = torch.cat([doc[:, :50], random_ids(6, seed=8)], 1)
    res = cache.prefill(ids)
    assert res.reused_tokens > 0
    _assert_generate_equal(model, ids, res.cache)


def test_no_attention_hit_past_the_usable_checkpoint_and_lost_tokens_counted():
    model = get_model("qwen3_5")
    cache = SparsePrefixCache(model, budget_bytes=64 * MiB, slots_per_entry=1, align=16, planner="balanced")
    doc = random_ids(64, seed=9)
    cache.prefill(doc)
    ids = torch.cat([doc[:, :60], random_ids(4, seed=10)], 1)
    hit = cache.lookup(ids)
    assert hit.overlap == 60 and 0 < hit.position < 60 and hit.position % 16 == 0
    assert hit.lost == 60 - hit.position
    res = cache.prefill(ids)
    assert res.lost_tokens == hit.lost and res.reused_tokens == hit.position
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


def test_append_only_chat_keeps_one_copy_of_the_conversation():
    model = get_model("qwen3_5")
    cache = SparsePrefixCache(model, budget_bytes=64 * MiB, align=8)
    convo = random_ids(20, seed=11)
    prev_len = 0
    for turn in range(4):
        res = cache.prefill(convo)
        if turn:  # the end state suffices (kept after L-1 tokens: generate feeds the last one)
            assert res.reused_tokens == prev_len - 1
        prev_len = convo.shape[1]
        convo = torch.cat([convo, random_ids(10, seed=20 + turn)], 1)
    assert cache.bytes_by_kind()["attention_kv"] == prev_len * cache.store.config.kv_bytes_per_token


def test_concurrent_prefills_are_exact():
    model = get_model("qwen3_5")
    cache = SparsePrefixCache(model, budget_bytes=64 * MiB, align=8)
    doc = random_ids(48, seed=12)
    reqs = [torch.cat([doc, random_ids(5, seed=30 + i)], 1) for i in range(6)]
    cache.prefill(doc)  # forward passes overlap outside the lock: give them something to resume from
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
    assert (
        cache.metrics.hits == 6
        and cache.bytes_by_kind()["attention_kv"] == (48 + 30) * cache.store.config.kv_bytes_per_token
    )


@pytest.mark.parametrize("policy", ["lru", "utility"])
@settings(max_examples=3, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["request", "insert", "pin", "unpin"]),
            st.integers(0, 3),
            st.integers(4, 40),
            st.integers(1, 12),
        ),
        min_size=2,
        max_size=6,
    )
)
def test_random_request_insert_pin_sequences_keep_budget_and_every_hit_exact(policy, ops):
    model = get_model("qwen3_5")
    ck = checkpoint_bytes(model.config)
    budget = 6 * ck  # a few requests' worth: forces evictions
    cache = SparsePrefixCache(model, budget_bytes=budget, slots_per_entry=3, align=4, policy=policy)
    docs = [random_ids(48, seed=100 + d) for d in range(4)]
    pinned: list[torch.Tensor] = []
    for op, doc_id, overlap, extra in ops:
        ids = torch.cat([docs[doc_id][:, :overlap], random_ids(extra, seed=overlap * 13 + extra)], 1)
        if op == "request":
            res = cache.prefill(ids)
            torch.testing.assert_close(res.logits, _full(model, ids), atol=1e-4, rtol=0)
        elif op == "insert":
            out = segmented_prefill(model, ids, cuts=[ids.shape[1] - 1])
            cache.insert(ids, restore_cache(model.config, out.snapshots[ids.shape[1] - 1]), trusted=True)
        elif op == "pin" and not pinned:
            cache.pin(docs[doc_id][:, :8])
            pinned.append(docs[doc_id][:, :8])
        elif op == "unpin" and pinned:
            cache.unpin(pinned.pop())
        assert cache.store.used_bytes == _held_bytes(cache) <= budget  # real tensor bytes, by storage
        for p in pinned:
            assert cache.lookup(p).overlap == p.shape[1]
        for v in cache.store.nodes():  # no orphan: every state lies on its node's edge, below stored KV
            assert all(v.top < q <= v.depth for q in v.states)


def test_a_model_whose_cache_cannot_be_snapshotted_is_refused():
    import transformers as tf

    from kvstate.errors import UnsupportedModelError

    gpt2 = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(UnsupportedModelError, match="supported families"):
        SparsePrefixCache(gpt2, budget_bytes=MiB)


def _held_bytes(cache: SparsePrefixCache) -> int:
    """Bytes of every tensor the store holds, each storage counted once."""
    seen: dict[int, int] = {}

    def add(t: torch.Tensor) -> None:
        st_ = t.untyped_storage()
        seen[st_.data_ptr()] = st_.nbytes()

    for v in cache.store.nodes():
        if isinstance(v.kv, KVSegment):
            for kv in v.kv.layers:
                if kv is not None:
                    add(kv[0])
                    add(kv[1])
        for s in v.states.values():
            for layer in s.payload.layers:
                if layer.recurrent is not None:
                    add(layer.recurrent.conv)
                    add(layer.recurrent.recurrent)
        for lg in v.logits.values():
            add(lg)
    return sum(seen.values())


def test_store_bytes_by_kind_add_up_to_the_tensors_held():
    model = get_model("bamba")
    cache = SparsePrefixCache(model, budget_bytes=64 * MiB, slots_per_entry=2, align=8)
    cache.prefill(random_ids(50, seed=40))
    kinds = cache.bytes_by_kind()
    sc = cache.store.config
    assert sum(kinds.values()) == cache.store.used_bytes == _held_bytes(cache)
    assert kinds["attention_kv"] == 50 * sc.kv_bytes_per_token and kinds["end_states"] == sc.checkpoint_bytes
    assert kinds["checkpoints"] > 0 and kinds["logits"] == sc.logits_bytes


def test_requests_sharing_a_document_hold_one_copy_of_its_kv():
    model = get_model("bamba")
    cache = SparsePrefixCache(model, budget_bytes=64 * MiB, slots_per_entry=2, align=8)
    doc = random_ids(64, seed=41)
    suffixes = [torch.tensor([[100 + i, 90 + i, 80 + i]]) for i in range(5)]  # distinct first tokens
    for sfx in suffixes:
        cache.prefill(torch.cat([doc, sfx], 1))
    sc = cache.store.config
    distinct = 64 + 5 * 3
    held = _held_bytes(cache)
    kv_held = held - cache.bytes_by_kind()["end_states"] - cache.bytes_by_kind()["checkpoints"]
    assert kv_held - 5 * sc.logits_bytes == distinct * sc.kv_bytes_per_token  # not 5 × 67 tokens
    assert held == cache.store.used_bytes


def test_second_request_to_a_document_captures_and_the_third_resumes():
    """The learning scenario on a tiny hybrid: overlap is recorded before the pass that reveals it."""
    model = get_model("qwen3_5")
    cache = SparsePrefixCache(model, budget_bytes=64 * MiB, slots_per_entry=1, align=8)
    doc = random_ids(80, seed=42)
    qs = [torch.cat([doc, torch.tensor([[100 + i, 110 + i, 120 + i]])], 1) for i in range(3)]
    first = cache.prefill(qs[0])
    second = cache.prefill(qs[1])
    third = cache.prefill(qs[2])
    assert first.reused_tokens == 0
    assert second.reused_tokens < 80  # only what the first request's blind plan offered
    assert third.reused_tokens == 80 and third.lost_tokens == 0  # captured by the second request
    for q, r in zip(qs, (first, second, third), strict=True):
        torch.testing.assert_close(r.logits, _full(model, q), atol=1e-4, rtol=0)


def test_generated_turn_insert_lets_the_next_turn_resume_after_the_reply():
    model = get_model("bamba")
    cache = SparsePrefixCache(model, budget_bytes=64 * MiB, slots_per_entry=2, align=8)
    prompt = random_ids(30, seed=43)
    res = cache.prefill(prompt)
    out = model.generate(
        prompt,
        cache=res.cache,
        attention_mask=res.attention_mask,
        max_new_tokens=6,
        min_new_tokens=6,
        do_sample=False,
        pad_token_id=0,
    )
    assert cache.insert(out, res.cache)  # the cache holds the output minus its last token
    turn2 = torch.cat([out, random_ids(5, seed=44)], 1)
    r2 = cache.prefill(turn2)
    assert r2.reused_tokens == out.shape[1] - 1
    torch.testing.assert_close(r2.logits, _full(model, turn2), atol=1e-4, rtol=0)
    with pytest.raises(KVStateError, match="covered"):
        cache.insert(out, res.cache, covered=3)


def test_pin_keeps_a_system_prompt_and_refuses_one_larger_than_the_budget():
    model = get_model("qwen3_5")
    ck = checkpoint_bytes(model.config)
    cache = SparsePrefixCache(model, budget_bytes=8 * ck, slots_per_entry=1, align=8)
    system = random_ids(24, seed=45)
    cache.pin(system)
    for i in range(4):
        cache.prefill(random_ids(40, seed=46 + i))
        assert cache.lookup(system).overlap == 24
    assert cache.prefill(system).recomputed_tokens == 0
    cache.unpin(system)
    with pytest.raises(BudgetError, match="budget"):
        cache.pin(random_ids(100_000, seed=1))


def test_states_can_live_on_another_device_and_restore_onto_the_models():
    model = get_model("qwen3_5")
    cache = SparsePrefixCache(
        model, PrefixCacheConfig(64 * MiB, slots_per_entry=2, align=8, state_device="cpu")
    )
    doc = random_ids(40, seed=47)
    cache.prefill(doc)
    ids = torch.cat([doc, random_ids(4, seed=48)], 1)
    res = cache.prefill(ids)
    assert res.reused_tokens > 0
    torch.testing.assert_close(res.logits, _full(model, ids), atol=1e-4, rtol=0)
    assert all(
        s.payload.layers[0].recurrent.conv.device.type == "cpu"
        for v in cache.store.nodes()
        for s in v.states.values()
    )


def test_metrics_snapshot_and_reset():
    model = get_model("qwen3_5")
    cache = SparsePrefixCache(model, budget_bytes=64 * MiB, align=8)
    ids = random_ids(20, seed=49)
    cache.prefill(ids)
    cache.prefill(ids)
    m = cache.metrics
    assert m.requests == 2 and m.hits == 1 and m.hit_rate == 0.5 and m.tokens_total == 40
    cache.reset_metrics()
    assert (
        cache.metrics.requests == 0 and m.requests == 2 and cache.metrics.used_bytes == cache.store.used_bytes
    )


@pytest.mark.parametrize("family", ["qwen3_5", "mamba2"])
def test_bf16_store_charges_the_bytes_its_tensors_hold(family):
    """Recurrent states and logits are charged in the dtype they are held in: a bf16 hybrid whose inserted
    states a kernel kept in bf16 (not the fp32 transformers uses), and a bf16 Mamba2 whose logits are fp32."""
    model = get_model(family, torch.bfloat16)
    cache = SparsePrefixCache(model, budget_bytes=64 * MiB, slots_per_entry=2, align=8)
    doc = random_ids(40, seed=60)
    res = cache.prefill(doc)
    cache.prefill(torch.cat([doc[:, :30], random_ids(5, seed=61)], 1))
    out = model.generate(doc, cache=res.cache, attention_mask=res.attention_mask, max_new_tokens=4,
                         min_new_tokens=4, do_sample=False, pad_token_id=0)
    for layer in res.cache.layers:  # as a kernel that keeps its recurrent state in the model's dtype would
        if hasattr(layer, "recurrent_states") and layer.recurrent_states[0] is not None:
            layer.recurrent_states[0] = layer.recurrent_states[0].to(torch.bfloat16)
    assert cache.insert(out, res.cache)
    held = [s for v in cache.store.nodes() for s in v.states.values()]
    dtypes = {lay.recurrent.recurrent.dtype for s in held for lay in s.payload.layers if lay.recurrent is not None}
    assert dtypes == {torch.float32, torch.bfloat16}  # both kinds are held
    assert cache.store.used_bytes == _held_bytes(cache) == sum(cache.bytes_by_kind().values())


def test_declared_boundary_lets_the_second_request_resume_exactly():
    """A document declared as a boundary: the second request sharing it resumes from its end (not the third)."""
    model = get_model("qwen3_5")
    doc = random_ids(200, seed=62)
    q1, q2 = torch.tensor([[101, 7, 8, 9, 10, 11]]), torch.tensor([[102, 12, 13, 14, 15]])
    first, second = torch.cat([doc, q1], 1), torch.cat([doc, q2], 1)
    cache = SparsePrefixCache(model, budget_bytes=64 * MiB)  # default slots; align = the chunk size (64)
    assert cache.prefill(first, boundaries=[200]).reused_tokens == 0
    res = cache.prefill(second, boundaries=[200])
    assert res.reused_tokens >= 200 and res.lost_tokens == 0
    torch.testing.assert_close(res.logits, _full(model, second), atol=1e-4, rtol=0)
    plain = SparsePrefixCache(model, budget_bytes=64 * MiB)  # without the declaration: not yet
    plain.prefill(first)
    assert plain.prefill(second).reused_tokens < 200


def test_bad_boundaries_name_the_argument_and_leave_the_store_unchanged():
    model = get_model("qwen3_5")
    cache = SparsePrefixCache(model, budget_bytes=MiB, align=8)
    ids = random_ids(12, seed=63)
    for bad in ([0, 4], [4, 13], [8, 4], [4, 4]):
        with pytest.raises(KVStateError, match="boundaries") as err:
            cache.prefill(ids, boundaries=bad)
        assert "sorted(set(" in str(err.value)
    assert cache.metrics.requests == 0 and cache.store.used_bytes == 0
    assert cache.prefill(ids, boundaries=[4, 12]).recomputed_tokens == 12  # in range: fine
