"""Continuous batching in the server's scheduler: requests decoded together equal each request decoded alone
(tokens equal, logprobs within fp32 noise) on every supported family and on models/ref-hybrid, with and without
a prefix-cache hit; a long prompt is prefilled in chunks with the batch decoded between them; a client that
goes away leaves the batch at once and the others' replies do not change."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstate.models import load_model, tiny_model
from kvstate.prefix.engine import SparsePrefixCache
from kvstate.serve.generation import Generation, GenerationRequest, Generator
from kvstate.serve.policy import BatchPolicy
from kvstate.serve.sampling import SamplingParams
from kvstate.serve.scheduler import QueueFull, Scheduler
from kvstate.serve.server import load_tokenizer
from tests.conftest import FAMILIES
from tests.lib.serve.conftest import word_tokenizer

REF = Path(__file__).resolve().parents[3] / "models" / "ref-hybrid"
MiB = 1 << 20
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, logprobs=1)  # ignore_eos: replies run to max_tokens


def _ids(n: int, seed: int, vocab: int, low: int = 10) -> tuple[int, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(int(t) for t in torch.randint(low, vocab, (n,), generator=g))


def _requests(vocab: int) -> list[GenerationRequest]:
    doc = _ids(40, 1, vocab)
    prompts = [doc + _ids(5, 2, vocab), _ids(13, 3, vocab), doc + _ids(9, 4, vocab), _ids(27, 5, vocab)]
    return [GenerationRequest(p, max_tokens=m, sampling=GREEDY) for p, m in zip(prompts, (7, 4, 9, 6), strict=True)]


async def _serve(scheduler: Scheduler, requests: list[GenerationRequest], cancel_after: dict[int, int] | None = None
                 ) -> list[Generation | None]:
    """Submit every request at once and collect each result (None for a request cancelled mid-reply)."""
    jobs = [scheduler.submit(r) for r in requests]
    cancel_after = cancel_after or {}

    async def collect(i: int) -> Generation | None:
        deltas = 0
        while True:
            kind, payload = await asyncio.wait_for(jobs[i].events.get(), timeout=120)
            if kind == "delta":
                deltas += 1
                if cancel_after.get(i) == deltas:
                    jobs[i].cancel()
            elif kind == "done":
                return payload  # type: ignore[no-any-return]
            elif kind == "cancelled":
                return None
            else:
                raise payload

    return list(await asyncio.gather(*(collect(i) for i in range(len(jobs)))))


def _batched(gen: Generator, requests: list[GenerationRequest], policy: BatchPolicy,
             cancel_after: dict[int, int] | None = None) -> tuple[list[Generation | None], Scheduler]:
    scheduler = Scheduler(16, gen, policy)

    async def main() -> list[Generation | None]:
        scheduler.start()
        try:
            return await _serve(scheduler, requests, cancel_after)
        finally:
            scheduler.stop()

    return asyncio.run(main()), scheduler


def _alone(gen: Generator, requests: list[GenerationRequest]) -> list[Generation]:
    return [gen.run(r, lambda _: None, lambda: False) for r in requests]


def _same(batched: Generation | None, alone: Generation) -> None:
    assert batched is not None and batched.reply_ids == alone.reply_ids and batched.finish_reason == alone.finish_reason
    torch.testing.assert_close(torch.tensor([t.logprob for t in batched.logprobs]),
                               torch.tensor([t.logprob for t in alone.logprobs]), atol=1e-4, rtol=0)


def _model(family: str) -> tuple[Any, Any]:
    if family == "ref-hybrid":
        return load_model(REF), load_tokenizer(REF)
    return tiny_model(family, seed=0), word_tokenizer()


@pytest.mark.parametrize("cached", [True, False], ids=["cache", "no-cache"])
@pytest.mark.parametrize("family", [*FAMILIES, "ref-hybrid"])
def test_batched_replies_equal_each_request_alone(family: str, cached: bool) -> None:
    model, tok = _model(family)
    vocab = int(model.get_output_embeddings().weight.shape[0])
    requests = _requests(min(vocab, 128))

    def gen() -> Generator:
        cache = SparsePrefixCache(model, 64 * MiB, slots_per_entry=2, align=8) if cached else None
        g = Generator(model, tok, cache)
        if cache is not None:  # the shared document is stored: requests 0 and 2 resume from it
            g.run(GenerationRequest((*requests[0].prompt_ids[:40], 11), 1), lambda _: None, lambda: False)
        return g

    alone = _alone(gen(), requests)
    batched, scheduler = _batched(gen(), requests, BatchPolicy(max_batch=4, max_tokens_per_step=8))
    for b, a in zip(batched, alone, strict=True):
        _same(b, a)
    assert scheduler.steps < sum(len(a.reply_ids) for a in alone) - len(alone)  # steps were shared: a real batch
    if cached:  # the requests sharing the stored document resumed from it, batched as alone
        assert all(b is not None and b.reused_tokens == a.reused_tokens > 0
                   for b, a in ((batched[0], alone[0]), (batched[2], alone[2])))


def test_a_long_prompt_is_prefilled_in_chunks_with_the_batch_decoded_between() -> None:
    model, tok = _model("qwen3_5")
    gen = Generator(model, tok, SparsePrefixCache(model, 64 * MiB, slots_per_entry=2, align=8))
    short = GenerationRequest(_ids(6, 7, 128), max_tokens=4, sampling=GREEDY)
    long = GenerationRequest(_ids(120, 8, 128), max_tokens=2, sampling=GREEDY)
    steps_during: dict[int, int] = {}
    prefill = gen.prefill

    def watched(d, chunk=None, between=None):  # type: ignore[no-untyped-def]
        before = scheduler_ref[0].steps
        p = prefill(d, chunk=chunk, between=between)
        steps_during[len(d.req.prompt_ids)] = scheduler_ref[0].steps - before
        return p

    gen.prefill = watched  # type: ignore[method-assign]
    scheduler_ref: list[Scheduler] = []
    policy = BatchPolicy(max_batch=4, max_tokens_per_step=16)
    scheduler = Scheduler(16, gen, policy)
    scheduler_ref.append(scheduler)

    async def main() -> list[Generation | None]:
        scheduler.start()
        try:
            return await _serve(scheduler, [short, long])
        finally:
            scheduler.stop()

    out = asyncio.run(main())
    # the short request's 3 decode steps ran while the long prompt was prefilled, 16 tokens at a time
    assert steps_during[120] == 3 and steps_during[6] == 0
    alone = _alone(Generator(model, tok, None), [short, long])
    for b, a in zip(out, alone, strict=True):
        _same(b, a)


def test_a_client_that_goes_away_leaves_the_batch_and_the_others_do_not_change() -> None:
    model, tok = _model("qwen3_5")
    requests = _requests(128)
    alone = _alone(Generator(model, tok, None), requests)
    gen = Generator(model, tok, SparsePrefixCache(model, 64 * MiB, slots_per_entry=2, align=8))
    out, scheduler = _batched(gen, requests, BatchPolicy(max_batch=4, max_tokens_per_step=64), cancel_after={2: 2})
    assert out[2] is None and scheduler.running == 0 and len(scheduler._batch or []) == 0
    for i in (0, 1, 3):
        _same(out[i], alone[i])
    stored = gen.cache.lookup(torch.tensor([requests[2].prompt_ids + alone[2].reply_ids]))
    assert stored.position <= len(requests[2].prompt_ids)  # the cancelled reply was not inserted


def test_the_batch_bound_holds_and_longest_prefix_first_admits_the_hit() -> None:
    model, tok = _model("qwen3_5")
    requests = _requests(128)
    gen = Generator(model, tok, SparsePrefixCache(model, 64 * MiB, slots_per_entry=2, align=8))
    gen.run(GenerationRequest((*requests[2].prompt_ids[:40], 11), 1), lambda _: None, lambda: False)
    order: list[int] = []
    prefill = gen.prefill

    def watched(d, chunk=None, between=None):  # type: ignore[no-untyped-def]
        order.append(len(d.req.prompt_ids))
        assert len(scheduler._batch or []) <= 2
        return prefill(d, chunk=chunk, between=between)

    gen.prefill = watched  # type: ignore[method-assign]
    scheduler = Scheduler(16, gen, BatchPolicy("longest-prefix", max_batch=2, max_tokens_per_step=64))

    async def main() -> list[Generation | None]:
        jobs_done = _serve(scheduler, requests)
        scheduler.start()  # every request is queued before the worker looks: the policy sees all four
        try:
            return await jobs_done
        finally:
            scheduler.stop()

    out = asyncio.run(main())
    assert all(o is not None for o in out)
    assert order[:2] == [45, 49]  # the two requests resuming from the stored document go first


def test_a_request_the_batch_can_take_is_never_refused_as_queue_full() -> None:
    model, tok = _model("qwen3_5")
    scheduler = Scheduler(1, Generator(model, tok, None), BatchPolicy(max_batch=3))
    requests = _requests(128)

    async def main() -> None:  # the worker is not started: nothing leaves the queue
        for r in requests[:3]:  # the 3 free rows take these, and --max-queue 1 one more
            scheduler.submit(r)
        scheduler.submit(requests[3])
        with pytest.raises(QueueFull, match="--max-queue 1"):
            scheduler.submit(requests[0])

    asyncio.run(main())
    assert scheduler.depth == 4


def test_a_prefill_that_starts_while_others_decode_runs_in_the_smaller_chunks() -> None:
    model, tok = _model("qwen3_5")
    gen = Generator(model, tok, SparsePrefixCache(model, 64 * MiB, slots_per_entry=2, align=8))
    short = GenerationRequest(_ids(6, 7, 128), max_tokens=12, sampling=GREEDY)
    long = GenerationRequest(_ids(120, 8, 128), max_tokens=3, sampling=GREEDY)
    chunks: dict[int, int | None] = {}
    prefill = gen.prefill

    def watched(d, chunk=None, between=None):  # type: ignore[no-untyped-def]
        chunks[len(d.req.prompt_ids)] = chunk
        return prefill(d, chunk=chunk, between=between)

    gen.prefill = watched  # type: ignore[method-assign]
    scheduler = Scheduler(16, gen, BatchPolicy(max_batch=4, max_tokens_per_step=64, max_prefill_while_decoding=8))

    async def main() -> list[Generation | None]:
        scheduler.start()
        try:
            first = scheduler.submit(short)
            kind, _ = await asyncio.wait_for(first.events.get(), timeout=120)  # the short reply decodes now
            assert kind == "delta"
            second = scheduler.submit(long)

            async def rest(job: Any) -> Generation:
                while True:
                    kind, payload = await asyncio.wait_for(job.events.get(), timeout=120)
                    if kind == "done":
                        return payload  # type: ignore[no-any-return]
                    if kind != "delta":
                        raise AssertionError(f"{kind}: {payload}")

            return list(await asyncio.gather(rest(first), rest(second)))
        finally:
            scheduler.stop()

    out = asyncio.run(main())
    assert chunks == {6: 64, 120: 8}  # started alone: the step budget; started beside a decode: the smaller one
    assert scheduler.prefill_calls >= 120 // 8  # one call of at most 8 tokens per step (plus the short's one)
    alone = _alone(Generator(model, tok, None), [short, long])
    for b, a in zip(out, alone, strict=True):
        _same(b, a)


def test_a_request_cancelled_mid_prefill_leaves_the_store_as_if_it_never_came() -> None:
    model, tok = _model("qwen3_5")
    requests = _requests(128)
    cache = SparsePrefixCache(model, 64 * MiB, slots_per_entry=2, align=8)
    gen = Generator(model, tok, cache)
    long = GenerationRequest(_ids(120, 9, 128), max_tokens=3, sampling=GREEDY)
    jobs: list[Any] = []
    prefill = gen.prefill
    calls: list[int] = []

    def watched(d, chunk=None, between=None):  # type: ignore[no-untyped-def]
        def counted() -> None:
            calls.append(len(d.req.prompt_ids))
            if calls.count(120) == 2:
                jobs[-1].cancel()  # the client goes away after its prompt's first two chunks
            between()
        return prefill(d, chunk=chunk, between=counted if between is not None else None)

    gen.prefill = watched  # type: ignore[method-assign]
    scheduler = Scheduler(16, gen, BatchPolicy(max_batch=4, max_tokens_per_step=16))

    async def main() -> list[Generation | None]:
        scheduler.start()
        try:
            jobs.append(scheduler.submit(long))
            kind, _ = await asyncio.wait_for(jobs[-1].events.get(), timeout=120)
            assert kind == "cancelled"
            return await _serve(scheduler, requests)  # the server goes on as before
        finally:
            scheduler.stop()

    out = asyncio.run(main())
    assert calls.count(120) == 2 and scheduler.running == 0  # 2 of its 8 chunks ran, then it was aborted
    assert cache.lookup(torch.tensor([long.prompt_ids])).position == 0  # nothing of it was stored
    assert all(v.pins == 0 for v in cache.store.nodes())  # nothing it touched stays pinned
    alone = _alone(Generator(model, tok, None), requests)
    for b, a in zip(out, alone, strict=True):
        _same(b, a)


def test_the_scheduler_asks_the_prefix_cache_one_explicit_question() -> None:
    model, tok = _model("qwen3_5")
    requests = _requests(128)
    gen = Generator(model, tok, SparsePrefixCache(model, 64 * MiB, slots_per_entry=2, align=8))
    assert gen.cached_tokens(requests[0].prompt_ids) == 0
    gen.run(GenerationRequest((*requests[0].prompt_ids[:40], 11), 1), lambda _: None, lambda: False)
    hit = gen.cache.lookup(torch.tensor([requests[0].prompt_ids]), full_state=True).position
    assert gen.cached_tokens(requests[0].prompt_ids) == hit > 0
    assert Generator(model, tok, None).cached_tokens(requests[0].prompt_ids) == 0
