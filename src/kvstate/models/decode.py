"""The one greedy decode loop (batch 1) over any cache object, timed step by step, and the explicit-position
forward every decode loop steps with.

Greedy decoding as in transformers' ``generate(do_sample=False)``; positions follow the model's rotary /
state indexing. Every measurement that generates text decodes through :func:`greedy_decode` (the lab's
evaluation harness, the semantic and transfer benchmarks, via :mod:`kvstate.lab.decode`), and the server's
decode step feeds its chosen token through :func:`forward_at` (:mod:`kvstate.serve.generation`). The cache is
anything the model accepts as ``cache=`` — a ``DynamicCache``, a ``Cache`` subclass, a sharing cache — and
it is only ever fed through the model's forward, so the loop needs nothing from it. Positions are always
passed explicitly: hybrid families such as Bamba restart at position 0 when they are left out, and a
compressed cache no longer knows how many tokens it stands for.

Ignored: batching, sampling, stop strings (only the end-of-sequence id stops early), attention masks.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvstate.errors import KVStateError


@dataclass(frozen=True)
class DecodeResult:
    """What one greedy decode produced and how long its forward calls took."""

    tokens: list[int]  # generated ids in order, without the end-of-sequence id
    first_ms: float  # wall ms of the forward over ``input_ids`` that gave the first logits (0.0 when logits were given)
    step_ms: list[float]  # wall ms of each single-token decode forward, in order
    stopped_at_eos: bool  # True: the end-of-sequence id was chosen; False: max_new_tokens was reached
    logits: tuple[torch.Tensor, ...] = ()  # keep_logits: (V,) fp32 logits that chose tokens[i], one per token

    @property
    def steps(self) -> int:
        """Single-token decode forwards run (the first logits' forward not counted)."""
        return len(self.step_ms)

    @property
    def decode_s(self) -> float:
        """Wall seconds of the single-token decode forwards."""
        return sum(self.step_ms) / 1e3


def as_ids(ids: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """Token ids as a ``(1, T)`` long tensor (from a list, a ``(T,)`` or a ``(1, T)`` tensor)."""
    return torch.as_tensor(ids, dtype=torch.long).reshape(1, -1)  # (1, T)


def forward_at(model: Any, cache: Any, ids: torch.Tensor | Sequence[int], start: int, *,
               last_only: bool = False, device: torch.device | None = None) -> torch.Tensor:
    """Logits ``(T, V)`` of ``ids`` fed at positions ``start .. start + T - 1`` on top of ``cache``.

    ``last_only``: compute the last position's logits only (``(1, V)``; a prefill's next-token logits).
    ``device``: where to put the ids and positions (default: the CPU tensors torch makes).
    """
    x = as_ids(ids)  # (1, T)
    pos = torch.arange(start, start + x.shape[1])[None]  # (1, T)
    if device is not None:
        x, pos = x.to(device), pos.to(device)
    kw: dict[str, Any] = {"logits_to_keep": 1} if last_only else {}
    logits: torch.Tensor = model(input_ids=x, position_ids=pos, cache=cache, use_cache=True, **kw).logits[0]
    return logits  # (T, V), or (1, V) with last_only


@torch.no_grad()
def greedy_decode(model: Any, cache: Any, start: int, max_new_tokens: int, eos_id: int | None, *,
                  input_ids: torch.Tensor | Sequence[int] | None = None, logits: torch.Tensor | None = None,
                  keep_logits: bool = False) -> DecodeResult:
    """Greedily decode up to ``max_new_tokens`` tokens from a cache holding ``start`` tokens.

    Give exactly one of ``input_ids`` (fed first at positions ``start ..``, e.g. the prompt into an empty
    cache or a question after a compressed context; timed as ``first_ms``) or ``logits`` (``(V,)``
    next-token logits the caller already has, e.g. from its own timed prefill). Stops before the
    end-of-sequence id or once ``max_new_tokens`` tokens are generated, without a forward after the last
    one. ``keep_logits`` returns the fp32 logits behind each token (for tests against recompute).
    """
    if (input_ids is None) == (logits is None):
        raise KVStateError("greedy_decode: pass exactly one of input_ids (to feed first) or logits (already computed)")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise KVStateError(f"greedy_decode: max_new_tokens={max_new_tokens!r} must be an int >= 1")
    if not isinstance(start, int) or start < 0:
        raise KVStateError(f"greedy_decode: start={start!r} must be an int >= 0 (tokens already in the cache)")
    first_ms, pos = 0.0, start
    if input_ids is not None:
        x = as_ids(input_ids)  # (1, T)
        if x.shape[1] == 0:
            raise KVStateError("greedy_decode: input_ids is empty; pass at least one token or the logits")
        t0 = time.perf_counter()
        logits = forward_at(model, cache, x, start)[-1]  # (V,)
        first_ms = 1e3 * (time.perf_counter() - t0)
        pos += x.shape[1]
    assert logits is not None  # one of the two was given (checked above)
    tokens: list[int] = []
    step_ms: list[float] = []
    kept: list[torch.Tensor] = []
    while True:
        nxt = int(logits.argmax())
        if nxt == eos_id:
            return DecodeResult(tokens, first_ms, step_ms, True, tuple(kept))
        tokens.append(nxt)
        if keep_logits:
            kept.append(logits.float().clone())
        if len(tokens) >= max_new_tokens:
            return DecodeResult(tokens, first_ms, step_ms, False, tuple(kept))
        t0 = time.perf_counter()
        logits = forward_at(model, cache, [nxt], pos)[-1]  # (V,)
        step_ms.append(1e3 * (time.perf_counter() - t0))
        pos += 1


__all__ = ["DecodeResult", "as_ids", "forward_at", "greedy_decode"]
