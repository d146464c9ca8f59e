"""``Sampler`` against written-out oracles: HF's logits processors for the repetition penalty, top-k and
top-p; greedy argmax for temperature 0 and top_k=1; empirical frequencies for the sampled distribution;
seeds that reproduce and seeds that differ; every validation error."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from kvstate.errors import KVStateError
from kvstate.serve.sampling import MAX_LOGPROBS, Sampler, SamplingParams, SeedSource

V = 50
EOS = 7


def _rows(n: int, seed: int = 0, scale: float = 3.0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(V, generator=g) * scale for _ in range(n)]


def _draw(params: SamplingParams, rows: list[torch.Tensor], prompt=(), eos=(EOS,), seeds=None) -> list[int]:
    sampler = Sampler(params, prompt, eos, seeds)
    out: list[int] = []
    for row in rows:
        out.append(sampler.next(row, out)[0])
    return out


def test_same_seed_same_tokens_different_seeds_differ():
    rows = _rows(40)
    a = _draw(SamplingParams(temperature=1.0, seed=11), rows)
    assert a == _draw(SamplingParams(temperature=1.0, seed=11), rows)
    assert a != _draw(SamplingParams(temperature=1.0, seed=12), rows)


def test_an_unseeded_request_records_the_seed_it_drew():
    rows = _rows(30)
    first, second = Sampler(SamplingParams(), [], [EOS], SeedSource(3)), Sampler(SamplingParams(), [], [EOS], SeedSource(3))
    assert first.seed == second.seed  # the seed source is explicit: same source seed, same request seeds
    source = SeedSource(3)
    drawn = [Sampler(SamplingParams(), [], [EOS], source).seed for _ in range(3)]
    assert len(set(drawn)) == 3  # successive requests get successive seeds
    unseeded = Sampler(SamplingParams(), [], [EOS], SeedSource(4))
    out: list[int] = []
    for row in rows:
        out.append(unseeded.next(row, out)[0])
    assert out == _draw(SamplingParams(seed=unseeded.seed), rows)  # replayable from the recorded seed


def test_temperature_zero_is_argmax_and_top_k_one_is_greedy():
    rows = _rows(30, seed=1)
    greedy = _draw(SamplingParams(temperature=0.0), rows)
    assert greedy == [int(r.argmax()) for r in rows]
    assert _draw(SamplingParams(temperature=1.3, top_k=1, seed=5), rows) == greedy
    assert _draw(SamplingParams(temperature=0.0, top_p=0.1, top_k=3), rows) == greedy  # ignored when greedy


def test_min_tokens_bans_eos_until_reached():
    row = torch.zeros(V)
    row[EOS] = 30.0  # EOS all but certain
    row[3] = 1.0
    for params in (SamplingParams(temperature=0.0, min_tokens=3), SamplingParams(temperature=1.0, min_tokens=3, seed=0)):
        out = _draw(params, [row] * 5)
        assert EOS not in out[:3] and out[3:] == [EOS, EOS]
    assert _draw(SamplingParams(temperature=0.0, min_tokens=3), [row] * 2, eos=()) == [EOS, EOS]  # no EOS ids: nothing banned


def test_stops_at_eos_unless_ignore_eos():
    assert Sampler(SamplingParams(), [], [EOS, 9]).stops_at(9)
    assert not Sampler(SamplingParams(), [], [EOS]).stops_at(8)
    assert not Sampler(SamplingParams(ignore_eos=True), [], [EOS]).stops_at(EOS)


@pytest.mark.parametrize("negative", [False, True])
@pytest.mark.parametrize("penalty", [1.8, 0.4])
def test_repetition_penalty_matches_hf(penalty, negative):
    rows = _rows(30, seed=2)
    if negative:  # every logit below 0: the penalty must multiply, not divide
        rows = [r - r.max() - 0.5 for r in rows]
    prompt = [1, 2, 3, 4, 5, 17, 30]
    hf = RepetitionPenaltyLogitsProcessor(penalty)
    out: list[int] = []
    sampler = Sampler(SamplingParams(temperature=0.0, repetition_penalty=penalty), prompt, [EOS])
    changed = 0
    for row in rows:
        seen = torch.tensor([[*prompt, *out]])
        want = int(hf(seen, row.unsqueeze(0).clone())[0].argmax())
        changed += want != int(row.argmax())
        out.append(sampler.next(row, out)[0])
        assert out[-1] == want
    assert changed > 0  # the penalty decided some tokens


@pytest.mark.parametrize(("temperature", "k", "p"), [(1.0, 5, 1.0), (0.7, 0, 0.6), (1.5, 8, 0.8)])
def test_sampled_tokens_follow_hf_top_k_top_p(temperature, k, p):
    """Tokens drawn lie in what HF's warpers keep and appear with the warped probabilities."""
    row = _rows(1, seed=3, scale=2.0)[0]
    warped = row.unsqueeze(0)
    warped = TemperatureLogitsWarper(temperature)(None, warped)
    if k:
        warped = TopKLogitsWarper(k)(None, warped)
    if p < 1:
        warped = TopPLogitsWarper(p)(None, warped)
    want = torch.softmax(warped[0], -1)  # (V,)
    n = 4000
    out = _draw(SamplingParams(temperature=temperature, top_k=k, top_p=p, seed=9), [row] * n)
    counts = torch.bincount(torch.tensor(out), minlength=V).float() / n
    assert set(out) == set(torch.nonzero(want > 0).flatten().tolist())
    torch.testing.assert_close(counts, want, atol=0.03, rtol=0)


def test_logprobs_are_the_raw_model_logprobs():
    row = _rows(1, seed=4)[0]
    raw = torch.log_softmax(row, -1)
    sampler = Sampler(SamplingParams(temperature=0.5, repetition_penalty=1.3, logprobs=3, seed=0), [1, 2], [EOS])
    token, logprob, top = sampler.next(row, [])
    assert math.isclose(logprob, float(raw[token]), abs_tol=1e-6)
    values, ids = raw.topk(3)
    assert [t for t, _ in top] == ids.tolist()
    assert all(math.isclose(lp, float(v), abs_tol=1e-6) for (_, lp), v in zip(top, values, strict=True))
    assert Sampler(SamplingParams(seed=0), [], [EOS]).next(row, [])[2] == []  # logprobs None: no list
    assert Sampler(SamplingParams(seed=0, logprobs=0), [], [EOS]).next(row, [])[2] == []


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("temperature", -0.1, ">= 0"),
        ("temperature", float("nan"), ">= 0"),
        ("temperature", "1", ">= 0"),
        ("top_p", 0.0, r"in \(0, 1\]"),
        ("top_p", 1.01, r"in \(0, 1\]"),
        ("top_k", -1, ">= 0"),
        ("top_k", 2.0, ">= 0"),
        ("repetition_penalty", 0.0, "> 0"),
        ("repetition_penalty", float("inf"), "> 0"),
        ("seed", 1.5, "integer"),
        ("seed", True, "integer"),
        ("seed", 2**64, "integer"),
        ("min_tokens", -1, ">= 0"),
        ("ignore_eos", 1, "true or false"),
        ("logprobs", -1, f"0..{MAX_LOGPROBS}"),
        ("logprobs", MAX_LOGPROBS + 1, f"0..{MAX_LOGPROBS}"),
    ],
)
def test_each_bad_parameter_is_one_clear_error(field, value, allowed):
    with pytest.raises(KVStateError, match=rf"SamplingParams\.{field} must be .*{allowed}.*got"):
        SamplingParams(**{field: value})


def test_bad_logits_are_refused():
    sampler = Sampler(SamplingParams(seed=0), [], [EOS])
    with pytest.raises(KVStateError, match=r"shape \(V,\), got \(2, 50\)"):
        sampler.next(torch.zeros(2, V), [])
    with pytest.raises(KVStateError, match="must be a SamplingParams"):
        Sampler({"temperature": 0}, [], [EOS])  # type: ignore[arg-type]
