"""Per-request sampling of the next token from one row of logits, with vLLM's ``SamplingParams`` semantics.

What each parameter does follows vLLM's sampler (``vllm/v1/sample``; "Efficient Memory Management for Large
Language Model Serving with PagedAttention", Kwon et al., SOSP 2023) and the OpenAI completions API it serves:

1. ``min_tokens``: end-of-sequence ids get ``-inf`` until that many tokens were generated;
2. ``repetition_penalty`` as in CTRL ("CTRL: A Conditional Transformer Language Model for Controllable
   Generation", Keskar et al., 2019) and HF / vLLM: the logit of every token already in prompt + output is
   divided by the penalty when positive and multiplied by it when negative;
3. ``temperature == 0`` (below 1e-5, as in vLLM): greedy (argmax of the penalized logits; top-k / top-p do not apply);
   otherwise the logits are divided by the temperature, then top-k, then top-p (nucleus sampling, "The
   Curious Case of Neural Text Degeneration", Holtzman et al., ICLR 2020) keep the smallest set of most
   likely tokens, and one token is drawn from what is left;
4. logprobs are the model's raw log-softmax (vLLM's default ``raw_logprobs``), before any of the above.

Randomness: every request owns a ``torch.Generator`` seeded with ``seed``, so a request draws the same
tokens whether it is decoded alone or in a batch (its logits agree up to float noise). A request without a
seed gets one drawn from a seed source passed in (by default one generator for the process, seeded from
the OS), and records it (:attr:`Sampler.seed`) so its reply can be reproduced.

Pure torch, one row at a time. Ignores: presence / frequency penalties, min-p, logit bias, stop strings
(the text layer handles those), beam search and ``n > 1``.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from kvstate.errors import KVStateError

MAX_LOGPROBS = 20  # the OpenAI API's limit on top_logprobs
GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS: a smaller temperature is greedy (dividing by it would overflow)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0: greedy; > 0 divides the logits
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]; 1: off
    top_k: int = 0  # most likely tokens kept; 0: off
    repetition_penalty: float = 1.0  # > 0; 1: off; > 1 discourages tokens of prompt + output
    seed: int | None = None  # the request's generator seed; None: drawn from the seed source
    min_tokens: int = 0  # end-of-sequence ids are banned until this many tokens were generated
    ignore_eos: bool = False  # an end-of-sequence token does not end the request
    logprobs: int | None = None  # top logprobs returned per token (0..MAX_LOGPROBS); None: none

    def __post_init__(self) -> None:
        _number("temperature", self.temperature, "a number >= 0 (0 = greedy)", lambda v: v >= 0)
        _number("top_p", self.top_p, "a number in (0, 1] (1 = off)", lambda v: 0 < v <= 1)
        _number("repetition_penalty", self.repetition_penalty, "a number > 0 (1 = off)", lambda v: v > 0)
        _integer("top_k", self.top_k, "an integer >= 0 (0 = off)", lambda v: v >= 0)
        _integer("min_tokens", self.min_tokens, "an integer >= 0", lambda v: v >= 0)
        if self.seed is not None:
            _integer("seed", self.seed, "an integer in [-2**63, 2**64) or None", lambda v: -(2**63) <= v < 2**64)
        if not isinstance(self.ignore_eos, bool):
            raise KVStateError(f"SamplingParams.ignore_eos must be true or false, got {self.ignore_eos!r}.")
        if self.logprobs is not None:
            _integer(
                "logprobs", self.logprobs, f"an integer in 0..{MAX_LOGPROBS} or None", lambda v: 0 <= v <= MAX_LOGPROBS
            )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def _number(name: str, value: object, allowed: str, ok: Callable[[float], bool]) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or not ok(value):
        raise KVStateError(f"SamplingParams.{name} must be {allowed}, got {value!r}.")


def _integer(name: str, value: object, allowed: str, ok: Callable[[int], bool]) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not ok(value):
        raise KVStateError(f"SamplingParams.{name} must be {allowed}, got {value!r}.")


class SeedSource:
    """Seeds for requests that bring none: one generator, drawn from under a lock (requests arrive on many
    threads). The process-wide default is seeded from the OS; tests pass their own."""

    def __init__(self, seed: int | None = None) -> None:
        self._gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") if seed is None else seed)
        self._lock = threading.Lock()

    def draw(self) -> int:
        with self._lock:
            return int(torch.randint(0, 2**62, (1,), generator=self._gen))


PROCESS_SEEDS = SeedSource()


class Sampler:
    """Chooses one request's tokens. ``prompt_ids`` feed the repetition penalty; ``eos_ids`` are the ids
    that end a reply (banned while fewer than ``min_tokens`` were generated)."""

    def __init__(
        self,
        params: SamplingParams,
        prompt_ids: Iterable[int],
        eos_ids: Iterable[int],
        seeds: SeedSource | None = None,
    ) -> None:
        if not isinstance(params, SamplingParams):
            raise KVStateError(f"Sampler: params must be a SamplingParams, got {type(params).__name__}.")
        self.params = params
        self.prompt_ids = tuple(int(t) for t in prompt_ids)
        self.eos_ids = frozenset(int(t) for t in eos_ids)
        # the seed this request draws with: reproduce the reply with SamplingParams(seed=sampler.seed)
        self.seed = params.seed if params.seed is not None else (seeds or PROCESS_SEEDS).draw()
        self._gen: torch.Generator | None = None  # made on the logits' device at the first draw

    def stops_at(self, token: int) -> bool:
        """Whether ``token`` ends the reply (an end-of-sequence id, unless ``ignore_eos``)."""
        return token in self.eos_ids and not self.params.ignore_eos

    def next(self, logits: torch.Tensor, generated: list[int]) -> tuple[int, float, list[tuple[int, float]]]:
        """The next token after ``generated`` (this request's tokens so far), its raw logprob, and the
        ``logprobs`` most likely tokens with theirs (empty when ``logprobs`` is None)."""
        if not isinstance(logits, torch.Tensor) or logits.dim() != 1 or logits.numel() == 0:
            shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
            raise KVStateError(f"Sampler.next: logits must be one row of shape (V,), got {shape}; pass logits[i].")
        p = self.params
        raw = torch.log_softmax(logits.float(), dim=-1)  # (V,)
        x = logits.float().clone()  # (V,)
        vocab = x.shape[0]
        if len(generated) < p.min_tokens and self.eos_ids:
            banned = [t for t in self.eos_ids if 0 <= t < vocab]
            x[banned] = -math.inf
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted({*self.prompt_ids, *generated}), dtype=torch.long, device=x.device)  # (S,)
            seen = seen[(seen >= 0) & (seen < vocab)]
            vals = x[seen]  # (S,)
            x[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if p.greedy:
            token = int(x.argmax())
        else:
            x = _top_k_top_p(x / p.temperature, p.top_k, p.top_p)
            token = int(torch.multinomial(torch.softmax(x, dim=-1), 1, generator=self._generator(x.device)))
        top: list[tuple[int, float]] = []
        if p.logprobs:
            values, ids = raw.topk(min(p.logprobs, vocab))
            top = [(int(i), float(v)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
        return token, float(raw[token]), top

    def _generator(self, device: torch.device) -> torch.Generator:
        if self._gen is None:
            # manual_seed takes [-2**63, 2**64); the same seed gives the same stream on one device type
            self._gen = torch.Generator(device=device).manual_seed(self.seed)
        return self._gen


def _top_k_top_p(x: torch.Tensor, k: int, p: float) -> torch.Tensor:
    """``x`` (V,) with every token outside the top ``k`` (0: all) and then outside the nucleus ``p`` at
    ``-inf``; the most likely token always survives."""
    if 0 < k < x.shape[0]:
        kth = x.topk(k).values[-1]  # ties with the k-th token are kept, as vLLM's threshold does
        x = x.masked_fill(x < kth, -math.inf)
    if p < 1.0:
        sorted_x, order = x.sort(descending=True)  # (V,), (V,)
        probs = torch.softmax(sorted_x, dim=-1)  # (V,)
        before = probs.cumsum(-1) - probs  # mass of the more likely tokens
        drop = before >= p  # the nucleus ends once p is reached; the first token has 0 before it
        x = x.scatter(0, order[drop], -math.inf)
    return x
