"""The scheduler's step plan (pure): every decoding row each step, the first prefill in line, and the chunk a
prefill runs in chosen by whether requests decode when it starts (Sarathi-Serve's stall-free budget)."""

from __future__ import annotations

import pytest

from kvstate.errors import KVStateError
from kvstate.serve.policy import BatchPolicy, StepPlan, plan_step


def test_a_step_decodes_every_row_and_advances_the_first_prefill_in_line() -> None:
    assert plan_step([3, 1], [7, 5]) == StepPlan((3, 1), 7)
    assert plan_step([], [5]) == StepPlan((), 5)
    assert plan_step([2], []) == StepPlan((2,), None)
    assert plan_step([], []).empty and not plan_step([1], []).empty and not plan_step([], [1]).empty


def test_the_chunk_is_the_step_budget_alone_and_the_smaller_one_beside_decodes() -> None:
    p = BatchPolicy(max_tokens_per_step=512, max_prefill_while_decoding=64)
    assert (p.chunk(decoding=False), p.chunk(decoding=True)) == (512, 64)
    assert BatchPolicy(max_tokens_per_step=512).chunk(decoding=True) == 512  # unset: one budget for both
    assert BatchPolicy(max_tokens_per_step=32, max_prefill_while_decoding=64).chunk(decoding=True) == 32


@pytest.mark.parametrize("bad", [0, -1, True, 2.5, 1 << 21])
def test_a_bad_prefill_while_decoding_budget_is_refused_naming_the_field(bad: object) -> None:
    with pytest.raises(KVStateError, match="max_prefill_while_decoding"):
        BatchPolicy(max_prefill_while_decoding=bad)  # type: ignore[arg-type]
