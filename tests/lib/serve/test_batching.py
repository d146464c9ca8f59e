"""Continuous batching (``DecodeBatch``) against its oracle: each request decoded alone.

For every supported family (tiny random configs) and the committed reference hybrid ``models/ref-hybrid``,
four requests of different prompt lengths — two sharing a prefix through a ``SparsePrefixCache`` hit —
join and leave a batch at different steps. Each request's greedy tokens equal its lone decode's (one
forward of the whole prompt, then one token per call, no prefix cache) and its per-step logits agree
within fp32 noise; a row that leaves does not change the others; ``cache_of`` continues exactly like
the lone cache, and the prefix cache takes it back.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers as tf

from kvstate.errors import BudgetError, KVStateError, UnsupportedModelError
from kvstate.models import ResumableCache, layer_kinds, load_model, restore_cache, snapshot_cache
from kvstate.models.state import AttentionState, CacheSnapshot, LayerSnapshot, RecurrentState
from kvstate.prefix.engine import SparsePrefixCache
from kvstate.serve.batching import BatchConfig, DecodeBatch
from kvstate.serve.sampling import Sampler, SamplingParams
from tests.conftest import FAMILIES, get_model

ATOL = 1e-4  # fp32: batched vs alone differ by reduction order only (measured ≤ 1e-6)
MiB = 1 << 20
REF_HYBRID = Path(__file__).resolve().parents[3] / "models" / "ref-hybrid"

_REF: list[object] = []


def _ref_hybrid():
    if not _REF:
        _REF.append(load_model(REF_HYBRID))
    return _REF[0]


def _model(name: str):
    return _ref_hybrid() if name == "ref-hybrid" else get_model(name)


MODELS = [*FAMILIES, "ref-hybrid"]


def _vocab(model) -> int:
    return int(model.get_output_embeddings().weight.shape[0])


def _prompts(model) -> dict[str, list[int]]:
    """Four prompts of different lengths; ``a`` and ``b`` share their first 40 tokens."""
    g = torch.Generator().manual_seed(5)
    v = _vocab(model)

    def ids(n: int) -> list[int]:
        return torch.randint(3, v, (n,), generator=g).tolist()

    doc = ids(40)
    return {"a": doc + ids(6), "b": doc + ids(13), "c": ids(9), "d": ids(27)}


def _forward(model, ids: list[int], start: int, cache) -> torch.Tensor:
    x = torch.tensor([ids])  # (1, t)
    positions = torch.arange(start, start + len(ids)).unsqueeze(0)  # (1, t)
    out = model(input_ids=x, position_ids=positions, cache=cache, use_cache=True, logits_to_keep=1)
    return out.logits[0, -1]  # (V,)


@torch.no_grad()
def _alone(model, prompt: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """The oracle: greedy tokens ``steps + 1`` (the first from the prompt's logits) and the logits of each
    decode step, one request with its own cache."""
    cache = ResumableCache(model.config)
    logits = _forward(model, prompt, 0, cache)
    tokens, per_step = [int(logits.argmax())], []
    for s in range(steps):
        logits = _forward(model, [tokens[-1]], len(prompt) + s, cache)
        per_step.append(logits)
        tokens.append(int(logits.argmax()))
    return tokens, per_step


# the schedule: (request, step it joins before, step it leaves after, decode steps it runs)
SCHEDULE = {"a": (0, 5), "c": (0, 2), "b": (2, 6), "d": (3, 4)}  # joins at step j, runs n steps


@torch.no_grad()
def _run_batched(model, prompts, schedule, max_batch: int = 4):
    """Serve ``prompts`` through one prefix cache and one batch along ``schedule``; per request its tokens,
    per-step logits, and the prefill results' reuse."""
    pc = SparsePrefixCache(model, budget_bytes=64 * MiB, slots_per_entry=4, align=8)
    batch = DecodeBatch(model, BatchConfig(max_batch=max_batch))
    tokens: dict[str, list[int]] = {}
    logits: dict[str, list[torch.Tensor]] = {}
    reused: dict[str, int] = {}
    last = max(j + n for j, n in schedule.values())
    for step in range(last):
        for rid, (join, _) in schedule.items():
            if join == step:
                res = pc.prefill(torch.tensor([prompts[rid]]), full_state=True)
                reused[rid] = res.reused_tokens
                batch.add(rid, res.cache, len(prompts[rid]))
                tokens[rid], logits[rid] = [int(res.logits[0].argmax())], []
        out = batch.step({rid: tokens[rid][-1] for rid in batch.rids})
        for rid, row in out.items():
            logits[rid].append(row.clone())
            tokens[rid].append(int(row.argmax()))
        for rid, (join, n) in schedule.items():
            if join + n == step + 1:
                batch.remove(rid)
    assert len(batch) == 0 and batch.padded_length == 0
    return tokens, logits, reused


@pytest.mark.parametrize("name", MODELS)
def test_batched_greedy_equals_each_request_alone(name):
    model = _model(name)
    prompts = _prompts(model)
    tokens, logits, reused = _run_batched(model, prompts, SCHEDULE)
    assert reused["b"] >= 8 and reused["a"] == 0  # b resumed from a's prefix: a real prefix-cache hit
    worst = 0.0
    for rid, (_, n) in SCHEDULE.items():
        want_tokens, want_logits = _alone(model, prompts[rid], n)
        assert tokens[rid] == want_tokens, (rid, tokens[rid], want_tokens)
        assert len(logits[rid]) == n
        for got, want in zip(logits[rid], want_logits, strict=True):
            torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
            worst = max(worst, float((got - want).abs().max()))
    print(f"{name}: max |batched - alone| logit = {worst:.2e}")


@pytest.mark.parametrize("name", ["qwen3_5", "falcon_h1", "mamba2", "llama"])
def test_a_row_leaving_changes_no_other_row(name):
    model = _model(name)
    prompts = _prompts(model)
    full = {"a": (0, 5), "b": (0, 5), "d": (0, 5)}
    early = {"a": (0, 5), "b": (0, 5), "d": (0, 2)}  # d (the longest prompt) leaves after step 2
    tok_full, log_full, _ = _run_batched(model, prompts, full)
    tok_early, log_early, _ = _run_batched(model, prompts, early)
    for rid in ("a", "b"):
        assert tok_early[rid] == tok_full[rid]
        for got, want in zip(log_early[rid], log_full[rid], strict=True):
            torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_left_padding_no_row_needs_is_trimmed():
    model = get_model("qwen3_5")
    prompts = _prompts(model)
    pc = SparsePrefixCache(model, budget_bytes=64 * MiB, align=8)
    batch = DecodeBatch(model)
    for rid in ("c", "d", "a"):  # 9, 27, 46 tokens
        batch.add(rid, pc.prefill(torch.tensor([prompts[rid]]), full_state=True).cache, len(prompts[rid]))
    assert batch.padded_length == 46 and batch.rids == ("c", "d", "a")
    batch.step({"c": 5, "d": 6, "a": 7})
    assert [batch.length(r) for r in batch.rids] == [10, 28, 47] and batch.padded_length == 47
    batch.remove("a")
    assert batch.padded_length == 28 and batch.rids == ("c", "d")
    batch.remove("d")
    assert batch.padded_length == 10


@pytest.mark.parametrize("name", MODELS)
def test_cache_of_continues_like_the_lone_cache(name):
    model = _model(name)
    prompts = _prompts(model)
    pc = SparsePrefixCache(model, budget_bytes=64 * MiB, slots_per_entry=4, align=8)
    batch = DecodeBatch(model)
    nxt = {}
    for rid in ("c", "b", "d"):  # 9, 59, 27 tokens: c and d are left-padded in the batch
        res = pc.prefill(torch.tensor([prompts[rid]]), full_state=True)
        batch.add(rid, res.cache, len(prompts[rid]))
        nxt[rid] = int(res.logits[0].argmax())
    with torch.no_grad():
        for _ in range(3):
            nxt = {rid: int(row.argmax()) for rid, row in batch.step(nxt).items()}
        owns = {rid: batch.cache_of(rid) for rid in batch.rids}
        batched = batch.step(nxt)  # the batch goes on untouched by cache_of
        for rid, own in owns.items():
            want_tokens, want_logits = _alone(model, prompts[rid], 4)
            assert batch.length(rid) == len(prompts[rid]) + 4 and nxt[rid] == want_tokens[3]
            assert isinstance(own, ResumableCache) and own.origin == pc.fingerprint
            lone = _forward(model, [nxt[rid]], len(prompts[rid]) + 3, own)  # one more step on the row's own cache
            torch.testing.assert_close(lone, want_logits[3], atol=ATOL, rtol=0)
            torch.testing.assert_close(batched[rid], want_logits[3], atol=ATOL, rtol=0)
    # the prefix cache takes a padded row's cache back (prompt + the 4 tokens fed); a next turn resumes there
    covered = prompts["d"] + _alone(model, prompts["d"], 4)[0][:4]
    other = [(t + 1) % _vocab(model) for t in covered]  # the row's cache keeps the tokens it was prefilled for
    with pytest.raises(KVStateError, match="computed for other tokens"):
        pc.insert(torch.tensor([[*other, 0]]), batch.cache_of("d"), covered=len(covered))
    assert pc.insert(torch.tensor([[*covered, 0]]), batch.cache_of("d"), covered=len(covered))
    assert pc.lookup(torch.tensor([[*covered, 3, 4]]), full_state=True).position == len(covered)


def test_cache_of_a_pure_recurrent_row_is_sealed_at_its_length():
    model = get_model("mamba2")
    prompts = _prompts(model)
    res = SparsePrefixCache(model, budget_bytes=64 * MiB, align=8).prefill(torch.tensor([prompts["c"]]), full_state=True)
    batch = DecodeBatch(model)
    with pytest.raises(KVStateError, match="holds the state after 9 tokens, not 8; pass length=9"):
        batch.add("c", res.cache, 8)
    batch.add("c", res.cache, 9)
    assert batch.padded_length == 0
    batch.step({"c": 4})
    assert batch.cache_of("c").covered_tokens == 10


@pytest.mark.parametrize("name", ["qwen3_5", "bamba"])
def test_seeded_sampling_gives_the_same_tokens_batched_or_alone(name):
    model = _model(name)
    prompts = _prompts(model)
    params = {rid: SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=i) for i, rid in enumerate("abcd")}
    steps = 6
    alone = {}
    with torch.no_grad():
        for rid, p in prompts.items():
            sampler, cache = Sampler(params[rid], p, eos_ids=[]), ResumableCache(model.config)
            logits, out = _forward(model, p, 0, cache), []
            for s in range(steps + 1):
                out.append(sampler.next(logits, out)[0])
                if s < steps:
                    logits = _forward(model, [out[-1]], len(p) + s, cache)
            alone[rid] = out
        pc = SparsePrefixCache(model, budget_bytes=64 * MiB, align=8)
        batch = DecodeBatch(model)
        samplers, out_b = {}, {}
        for rid, p in prompts.items():
            res = pc.prefill(torch.tensor([p]), full_state=True)
            batch.add(rid, res.cache, len(p))
            samplers[rid] = Sampler(params[rid], p, eos_ids=[])
            out_b[rid] = [samplers[rid].next(res.logits[0], [])[0]]
        for _ in range(steps):
            rows = batch.step({rid: toks[-1] for rid, toks in out_b.items()})
            for rid, row in rows.items():
                out_b[rid].append(samplers[rid].next(row, out_b[rid])[0])
    assert out_b == alone
    assert len({tuple(t) for t in alone.values()}) == 4


# -- bad inputs -------------------------------------------------------------------------------------


def _prefilled(model, n: int, seed: int = 0) -> ResumableCache:
    ids = torch.randint(3, _vocab(model), (1, n), generator=torch.Generator().manual_seed(seed))
    cache = ResumableCache(model.config)
    with torch.no_grad():
        model(input_ids=ids, position_ids=torch.arange(n).unsqueeze(0), cache=cache, use_cache=True, logits_to_keep=1)
    return cache.seal(n)


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "4"])
def test_batch_config_refuses_a_bad_max_batch(value):
    with pytest.raises(KVStateError, match="max_batch"):
        BatchConfig(max_batch=value)


def test_add_refuses_bad_rows():
    model = get_model("qwen3_5")
    batch = DecodeBatch(model, BatchConfig(max_batch=2))
    batch.add("x", _prefilled(model, 5), 5)
    with pytest.raises(KVStateError, match="already in the batch"):
        batch.add("x", _prefilled(model, 5), 5)
    with pytest.raises(KVStateError, match="holds 5 tokens of KV but the snapshot was asked at 6"):
        batch.add("y", _prefilled(model, 5), 6)
    with pytest.raises(KVStateError, match="length must be an integer >= 1"):
        batch.add("y", _prefilled(model, 5), 0)
    with pytest.raises(KVStateError, match="must be a DynamicCache"):
        batch.add("y", {"keys": None}, 5)  # type: ignore[arg-type]
    kinds = layer_kinds(model.config)
    two = snapshot_cache(_prefilled(model, 5), 5, kinds)
    doubled = CacheSnapshot(5, tuple(
        LayerSnapshot(
            layer.kind,
            None if layer.attention is None else AttentionState(*(t.repeat(2, 1, 1, 1) for t in (layer.attention.keys, layer.attention.values))),
            None if layer.recurrent is None else RecurrentState(layer.recurrent.conv.repeat(2, 1, 1), layer.recurrent.recurrent.repeat(2, 1, 1, 1)),
        )
        for layer in two.layers
    ))
    with pytest.raises(KVStateError, match="batch size 2"):
        batch.add("y", restore_cache(model.config, doubled), 5)
    half = CacheSnapshot(5, tuple(
        LayerSnapshot(
            layer.kind,
            layer.attention,
            None if layer.recurrent is None else RecurrentState(layer.recurrent.conv.double(), layer.recurrent.recurrent),
        )
        for layer in two.layers
    ))
    with pytest.raises(KVStateError, match=r"conv state is .*float64.*the batch's rows hold .*float32"):
        batch.add("y", restore_cache(model.config, half), 5)
    assert batch.rids == ("x",)  # nothing half-added
    batch.add("y", _prefilled(model, 7), 7)
    with pytest.raises(BudgetError, match="batch is full"):
        batch.add("z", _prefilled(model, 5), 5)


def test_step_and_remove_refuse_bad_calls():
    model = get_model("llama")
    batch = DecodeBatch(model)
    with pytest.raises(KVStateError, match="batch is empty"):
        batch.step({})
    batch.add("x", _prefilled(model, 4), 4)
    batch.add("y", _prefilled(model, 6, seed=1), 6)
    with pytest.raises(KVStateError, match=r"missing \['y'\], not in the batch \['z'\]"):
        batch.step({"x": 1, "z": 2})
    with pytest.raises(KVStateError, match=r"not a token id in 0\.\.127"):
        batch.step({"x": 1, "y": 128})
    with pytest.raises(KVStateError, match="'q' is not in the batch"):
        batch.remove("q")
    with pytest.raises(KVStateError, match="'q' is not in the batch"):
        batch.cache_of("q")
    assert [batch.length(r) for r in batch.rids] == [4, 6]  # refused calls changed nothing


def test_a_failed_step_loses_the_batch_until_it_is_emptied():
    model = get_model("qwen3_5")
    batch = DecodeBatch(model)
    batch.add("x", _prefilled(model, 4), 4)

    def boom(*_):
        raise RuntimeError("device lost")

    handle = model.model.layers[2].register_forward_hook(boom)
    try:
        with pytest.raises(RuntimeError, match="device lost"):
            batch.step({"x": 1})
    finally:
        handle.remove()
    with pytest.raises(KVStateError, match=r"state was lost.*prefill those requests again"):
        batch.step({"x": 1})
    with pytest.raises(KVStateError, match="state was lost"):
        batch.cache_of("x")
    batch.remove("x")
    batch.add("x", _prefilled(model, 4), 4)
    assert set(batch.step({"x": 1})) == {"x"}


def test_an_unsupported_family_is_refused():
    config = tf.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64)
    model = tf.AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(UnsupportedModelError, match="model_type 'gpt2' is not supported"):
        DecodeBatch(model)
