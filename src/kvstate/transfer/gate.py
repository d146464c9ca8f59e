"""A receiving-side gate for cross-model state transfer: check a transferred cache before serving from it.

For *Semantic Cache Distillation* and its baselines (``docs/techniques.md#across-models``), whose transfers can
be wrong for the consumer without any error being raised. The check costs the consumer a forward pass over the
last ``tokens`` context tokens: it drops those tokens from the transferred cache, recomputes them itself on top
of the rest (attending to the transferred prefix), and compares its own keys and values of those tokens with the
transferred ones — a faithful transfer is one the consumer reproduces. The reading is the mean, over layers, of
the relative L2 error of K and V (:class:`GateReading`); the gate accepts when it is at most ``max_error`` and
otherwise the consumer falls back to its own prefill. The teacher-forced NLL of those tokens under the
transferred prefix is read from the same pass (a second signal, not used by the decision).

The transferred cache is never changed (the check works on a copy). Ignored: a per-method threshold (one gate
serves every method), recomputing more than the last tokens.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

from kvstate.errors import KVStateError
from kvstate.transfer.states import continue_logits


class GateError(KVStateError):
    """A gate setting or input that cannot be checked."""


class GateRefused(KVStateError):
    """The gate refused a transferred cache (the consumer falls back to its own prefill)."""


@dataclass(frozen=True)
class GateConfig:
    """The gate: how many last context tokens the consumer recomputes, and the error it accepts."""

    tokens: int = 32
    # the real pair's dev pilot (docs/results/smollm2_pair_bench_pilot2.json, seed 475): every method read 0.22-0.47
    # (the consumer's own cache ~0) and each served wrong answers; any threshold below 0.22 served none of them
    max_error: float = 0.1

    def __post_init__(self) -> None:
        if not isinstance(self.tokens, int) or self.tokens < 2:
            raise GateError(f"GateConfig: tokens={self.tokens!r} must be an int >= 2 (e.g. 32)")
        if not isinstance(self.max_error, float | int) or not float(self.max_error) >= 0.0:
            raise GateError(f"GateConfig: max_error={self.max_error!r} must be a number >= 0 (e.g. 0.1)")


@dataclass(frozen=True)
class GateReading:
    """One check: the mean relative K/V error over layers, each layer's, the NLL of the checked tokens and the
    decision."""

    error: float
    layer_errors: tuple[float, ...]
    nll: float
    accept: bool


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12))


@torch.inference_mode()
def read_gate(consumer: Any, cache: Any, ids: torch.Tensor, cfg: GateConfig = GateConfig()) -> GateReading:
    """Check the transferred ``cache`` of ``ids`` (1, T) — the tokens it holds — with the consumer."""
    t = int(ids.shape[1])
    held = int(cache.get_seq_length())
    if ids.dim() != 2 or ids.shape[0] != 1 or held != t:
        raise GateError(f"read_gate: the cache holds {held} tokens but ids has shape {tuple(ids.shape)}; pass the "
                        f"(1, T) ids the cache was built from")
    m = min(cfg.tokens, t - 1)
    if m < 2:
        raise GateError(f"read_gate: a context of {t} tokens is too short to check (need at least 3)")
    sent = [(layer.keys[..., t - m:, :].clone(), layer.values[..., t - m:, :].clone()) for layer in cache.layers]
    own = copy.deepcopy(cache)
    own.crop(-m)  # transformers 5: a negative count removes that many tokens
    logits = continue_logits(consumer, own, ids, t - m)
    errors = []
    for (k, v), layer in zip(sent, own.layers, strict=True):
        errors.append(0.5 * (_rel(k, layer.keys[..., t - m:, :]) + _rel(v, layer.values[..., t - m:, :])))
    lp = torch.log_softmax(logits[:-1].double(), -1)
    nll = float(-lp.gather(1, ids[0, t - m + 1:, None]).mean())
    err = sum(errors) / len(errors)
    return GateReading(round(err, 6), tuple(round(e, 6) for e in errors), round(nll, 6), err <= cfg.max_error)


__all__ = ["GateConfig", "GateError", "GateReading", "GateRefused", "read_gate"]
