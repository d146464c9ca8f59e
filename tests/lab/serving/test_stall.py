"""The stall benchmark's parts: its prompts, its per-run figures against hand counts, its closed-loop client on
a tiny hybrid served by the real scheduler, and the targets it commits (per task and arm, the issue's bounds)."""

from __future__ import annotations

import asyncio
import random

import pytest

from kvstate.lab.serving import stall as S
from kvstate.models import tiny_model
from kvstate.prefix.engine import SparsePrefixCache
from kvstate.prefix.grid import GridConfig
from kvstate.serve.generation import Generator
from kvstate.serve.policy import BatchPolicy
from kvstate.serve.scheduler import Scheduler
from tests.lib.serve.conftest import word_tokenizer

LOAD = S.Load(prefix_tokens=24, suffix_tokens=4, output_tokens=3, requests_c1=2, requests_c8=6)


def test_shared_prefix_prompts_take_four_prefixes_in_turn_and_the_others_share_only_bos() -> None:
    ids = list(range(10, 100))
    shared = S.prompts(ids, (1,), "shared-prefix", 9, LOAD, random.Random(0))
    assert all(len(p) == 28 for p in shared)
    assert all(shared[i][:24] == shared[i + 4][:24] for i in range(5)) and shared[0][:24] != shared[1][:24]
    fresh = S.prompts(ids, (1,), "no-shared-prefix", 6, LOAD, random.Random(0))
    assert len({p[:24] for p in fresh}) == 6 and all(p[0] == 1 for p in fresh)


def _req(start: float, ttft: float, gaps: list[float], reused: int, end: float = 10.0, tokens: int = 4) -> dict:
    return {"start": start, "end": end, "ttft": ttft, "gaps": gaps, "tokens": tokens, "reused": reused, "prompt": 28}


def test_a_runs_figures_match_hand_counts() -> None:
    reqs = [_req(0.0, 0.1, [0.01, 0.02], 0), _req(0.0, 0.6, [0.01], 0), _req(1.0, 0.2, [0.2, 0.2], 0),
            _req(2.0, 0.1, [0.03], 0), _req(2.0, 0.1, [0.01], 24), _req(3.0, 0.1, [0.01], 12)]
    row = S.summarize(reqs, "shared-prefix", LOAD)
    assert row["requests"] == 6 and row["ttft_p50_s"] == pytest.approx(0.1)
    assert row["itl_p50_s"] == pytest.approx(0.015)  # median of the 8 gaps
    assert row["output_tok_s"] == pytest.approx(24 / 10.0)
    assert row["goodput"] == pytest.approx(4 / 6)  # one late first token, one slow stream
    assert (row["later_visits"], row["later_visits_restoring_90pct"]) == (2, 1)  # 24 / 24 yes, 12 / 24 no
    assert "later_visits" not in S.summarize(reqs, "no-shared-prefix", LOAD)


def test_the_closed_loop_client_runs_every_request_through_the_scheduler() -> None:
    model, tok = tiny_model("qwen3_5", seed=0), word_tokenizer()
    ids = list(range(10, 128))
    batch = S.prompts(ids, (1,), "shared-prefix", 6, LOAD, random.Random(1))
    cache = SparsePrefixCache(model, 64 << 20, slots_per_entry=2, align=8, grid=GridConfig(block=8))
    scheduler = Scheduler(16, Generator(model, tok, cache), BatchPolicy(max_batch=4, max_tokens_per_step=8))

    async def go() -> list[dict]:
        scheduler.start()
        try:
            return await S.closed_loop(scheduler, batch, 3, LOAD.output_tokens)
        finally:
            scheduler.stop()

    reqs = asyncio.run(go())
    assert [r["tokens"] for r in reqs] == [3] * 6 and all(r["prompt"] == 28 for r in reqs)
    assert all(0 < r["ttft"] <= r["end"] - r["start"] and len(r["gaps"]) <= 2 for r in reqs)
    assert sum(r["reused"] for r in reqs[4:]) > 0  # a later visit of a prefix restored some of it


def test_the_targets_are_committed_per_task_and_arm_at_the_issues_bounds() -> None:
    whole, plan = S.plans(S.MODEL, 1072, 5, S.Load())
    assert whole.tasks == S.TASKS and set(plan) == set(S.TASKS)
    labels = [(t.label, t.method, t.against, t.threshold) for trio in plan.values() for e in trio for t in e.targets]
    assert len(labels) == len(S.TASKS) * 3 * len(S.DEFAULT_ARMS)
    assert {x[3] for x in labels} == {2.5, 4.0, 1 / 3}
    assert all(m.endswith("@c8") and a == m.replace("@c8", "@c1") for _, m, a, _ in labels)
    assert all(e.kind == "timing" and e.repeats >= 5 for trio in plan.values() for e in trio)
    assert S.DEFAULT_ARMS[0] == "chunk512" and S.ARMS["chunk512"] is None  # the server's default is in the test
