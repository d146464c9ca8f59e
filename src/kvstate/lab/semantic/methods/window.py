"""StreamingLLM-like and window-only baselines: keep the first tokens and a recent window, evict the rest.

After "Efficient Streaming Language Models with Attention Sinks": the cache keeps ``sinks`` attention-sink
tokens and the most recent tokens, as many as the budget allows (``budget`` x the full KV of the tokens
seen, at every forward call: the window rolls as tokens are fed, the oldest non-sink token evicted
first). With ``sinks=0`` it is the window-only control (for the hybrid reference model: its recurrent
layers carry the far context, the attention layer sees only the window). Evicted tokens are gone: resident
= total = attended = the kept K/V (:mod:`kvstate.semantic.accounting`). Runs through the same cache and
attention hooks as SEKV (:class:`kvstate.semantic.SemanticCache` with a :class:`WindowStore` per layer).
Ignored: StreamingLLM's re-assignment of positions inside the cache (keys keep their original rotary
positions here, as kvpress's StreamingLLMPress keeps them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from kvstate.errors import BudgetError
from kvstate.lab.semantic.methods.base import Context, StoreMethod, register
from kvstate.semantic.cache import SemanticCache
from kvstate.semantic.config import SemanticConfig
from kvstate.semantic.segment import SegmentConfig


def anchor_logits(query: torch.Tensor, anchor_k: torch.Tensor, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped queries ``(H, g*Tq, D)`` of ``query`` (1, Hq, Tq, D) and their causal logits against the
    anchors ``anchor_k`` (1, H, A, D) (the fed tokens are the anchors' last ``Tq``): ``(H, g*Tq, A)``."""
    q = query[0]  # (Hq, Tq, D)
    hq, tq, d = q.shape
    h = anchor_k.shape[1]
    g = hq // h
    qg = q.reshape(h, g * tq, d)  # (H, g*Tq, D)
    a = anchor_k.shape[2]
    causal = (torch.arange(a)[None, :] > torch.arange(a - tq, a)[:, None]).repeat(g, 1)  # (g*Tq, A)
    return qg, (qg @ anchor_k[0].transpose(-1, -2) * scaling).masked_fill(causal, float("-inf"))


@dataclass
class WindowStore:
    anchor_k: torch.Tensor  # (1, H, K, D) the sinks, then the window (tokens fed since compression included)
    anchor_v: torch.Tensor
    sinks: int
    budget: float
    seen: int  # tokens fed so far (context included)
    expanded: list[float] = field(default_factory=list)  # unused: no spans
    reads: list[int] = field(default_factory=list)
    full_at: list[int] = field(default_factory=list)

    @property
    def token_bytes(self) -> int:
        return 2 * self.anchor_k.shape[1] * self.anchor_k.shape[3] * self.anchor_k.element_size()

    def fast_nbytes(self) -> int:
        return self.anchor_k.nbytes + self.anchor_v.nbytes

    def working_nbytes(self) -> int:
        return 0

    def slow_nbytes(self) -> int:
        return 0

    def full_nbytes(self) -> int:
        return self.seen * self.token_bytes

    def append(self, keys: torch.Tensor, values: torch.Tensor, *_: Any) -> None:
        self.anchor_k = torch.cat([self.anchor_k, keys], 2)
        self.anchor_v = torch.cat([self.anchor_v, values], 2)
        self.seen += keys.shape[2]
        keep = max(int(self.budget * self.seen), self.sinks + keys.shape[2])  # the fed tokens always stay
        drop = self.anchor_k.shape[2] - keep
        if drop > 0:
            idx = torch.cat([torch.arange(self.sinks), torch.arange(self.sinks + drop, self.anchor_k.shape[2])])
            self.anchor_k, self.anchor_v = self.anchor_k[:, :, idx], self.anchor_v[:, :, idx]

    def attend(self, query: torch.Tensor, scaling: float, *_: Any) -> torch.Tensor:
        hq, tq, d = query.shape[1:]
        _, logits = anchor_logits(query, self.anchor_k, scaling)
        self.reads.append(self.fast_nbytes())
        self.full_at.append(self.full_nbytes())
        p = torch.softmax(logits.float(), -1).to(query.dtype)
        return (p @ self.anchor_v[0]).reshape(1, hq, tq, d)


class WindowCache(SemanticCache):
    """Sinks + a rolling recent window within the budget; ``config.segment.sinks = 0``: window only."""

    def compress(self, surprisal_values: Any = None) -> Any:  # ignores surprisal
        layers = self.semantic_layers
        k0 = layers[0].keys
        t = k0.shape[2]
        sinks = min(self.config.segment.sinks, t)
        keep = int(self.config.budget * t)
        if keep <= sinks:
            raise BudgetError(f"budget {self.config.budget} of full KV keeps {keep} of {t} tokens, no more than the "
                              f"{sinks} sinks: the minimum is {sinks + 1} tokens, budget >= {(sinks + 1) / t:.4f}")
        idx = torch.cat([torch.arange(sinks), torch.arange(t - (keep - sinks), t)])
        for layer in layers:
            layer.store = WindowStore(layer.keys[:, :, idx].contiguous(), layer.values[:, :, idx].contiguous(),
                                      sinks, self.config.budget, t)
            layer.keys = layer.values = None
        return None


class Streaming(StoreMethod):
    name: ClassVar[str] = "streaming"
    about: ClassVar[str] = "StreamingLLM-like: attention sinks + a rolling recent window within the budget"
    cache_class: ClassVar[type] = WindowCache

    def config(self, budget: float, ctx: Context) -> SemanticConfig:
        return SemanticConfig(budget=budget, segment=ctx.segment, zoom="none", slow_tier=False)


class Window(Streaming):
    name: ClassVar[str] = "window"
    about: ClassVar[str] = "the recent window only (no sinks): the control for the hybrid model"

    def config(self, budget: float, ctx: Context) -> SemanticConfig:
        return SemanticConfig(budget=budget, segment=SegmentConfig(sinks=0, recent=ctx.segment.recent), zoom="none",
                              slow_tier=False)


register(Streaming())
register(Window())
