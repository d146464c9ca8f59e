"""Greedy generation for one request with the sparse prefix cache under it (or none, to compare).

A request is prefilled through :meth:`SparsePrefixCache.prefill` (resume from the deepest stored state,
compute the suffix, capture the planned checkpoints — and the message ends as declared checkpoints when
the engine accepts ``boundaries``; ``full_state=True``: the cache after the whole prompt), then decoded greedily one token per forward call with explicit
``position_ids`` on the returned cache. When the reply is complete, prompt + reply is inserted into the
cache (``insert``: the state after every token but the last, exactly what the next turn's prompt
extends). A cancelled request (a client that went away) stops at the next token and inserts nothing;
what its prefill pinned was released when the prefill committed. Without a cache the prompt is one
forward call and the decode loop is the same, so replies agree up to floating-point noise (greedy).

Runs on the scheduler's single worker thread: the model and the cache are used from that thread only.
Ignores: sampling, batching several requests into one forward pass.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvstate.models import ResumableCache
from kvstate.models.families import text_config
from kvstate.serve.text import TextStream


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: tuple[int, ...]
    max_tokens: int  # reply tokens at most (the end-of-sequence token counts)
    stops: tuple[str, ...] = ()  # the reply ends before the first of these strings
    boundaries: tuple[int, ...] = ()  # message-end positions to checkpoint (chat), in (0, len - 1)


@dataclass(frozen=True)
class Generation:
    text: str  # the reply (stop string and end-of-sequence excluded)
    finish_reason: str  # "stop" (end of sequence or a stop string), "length" or "cancelled"
    prompt_tokens: int
    completion_tokens: int  # tokens generated, the end-of-sequence token included
    reused_tokens: int  # prompt tokens restored from the prefix cache
    recomputed_tokens: int  # prompt tokens run through the model
    lost_tokens: int  # prompt tokens stored but recomputed for want of a checkpoint
    inserted: bool  # prompt + reply went into the prefix cache


class Generator:
    """Serves :class:`GenerationRequest` s on one model, with an optional :class:`SparsePrefixCache`."""

    def __init__(self, model: Any, tokenizer: Any, cache: Any | None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.cache = cache
        self.device = next(model.parameters()).device
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.max_positions: int | None = getattr(text_config(model.config), "max_position_embeddings", None)
        self.eos_ids = self._eos_ids()
        # the engine may take declared checkpoint positions; older engines plan without them
        params = inspect.signature(cache.prefill).parameters if cache is not None else {}
        self.accepts_boundaries = "boundaries" in params
        self.accepts_full_state = "full_state" in params  # older engines return generate's T-1 cache only
        self.pinned_nodes = 0  # store nodes still pinned after the last request (0 unless a user pinned one)

    def _eos_ids(self) -> frozenset[int]:
        out: set[int] = set()
        gc = getattr(self.model, "generation_config", None)
        for v in (getattr(gc, "eos_token_id", None), getattr(self.model.config, "eos_token_id", None),
                  getattr(self.tokenizer, "eos_token_id", None)):
            if isinstance(v, int):
                out.add(v)
            elif isinstance(v, list | tuple):
                out.update(int(x) for x in v)
        return frozenset(out)

    def request_bytes(self, tokens: int) -> int:
        """Bytes the prefix cache would hold for a request of ``tokens`` tokens (KV + one state + logits)."""
        if self.cache is None:
            return 0
        sc = self.cache.store.config
        return int(tokens * sc.kv_bytes_per_token + sc.checkpoint_bytes + sc.logits_bytes)

    def _forward(self, ids: list[int], start: int, cache: Any) -> torch.Tensor:
        """Feed ``ids`` at positions ``start..``; the last position's logits ``(1, V)``."""
        x = torch.tensor([ids], device=self.device)  # (1, t)
        positions = torch.arange(start, start + len(ids), device=self.device).unsqueeze(0)  # (1, t)
        out = self.model(input_ids=x, position_ids=positions, cache=cache, use_cache=True, logits_to_keep=1)
        logits: torch.Tensor = out.logits[:, -1]  # (1, V)
        return logits

    def _prefill(self, req: GenerationRequest) -> tuple[Any, torch.Tensor, list[int], tuple[int, int, int]]:
        """The cache, the last prompt position's logits, the prompt tokens the cache does not cover yet,
        and (reused, recomputed, lost) prompt tokens."""
        ids = list(req.prompt_ids)
        if self.cache is None:
            cache = ResumableCache(self.model.config)
            return cache, self._forward(ids, 0, cache), [], (0, len(ids), 0)
        x = torch.tensor([ids], device=self.device)
        kw: dict[str, Any] = {"boundaries": list(req.boundaries)} if self.accepts_boundaries and req.boundaries else {}
        pending: list[int] = ids[-1:]  # generate's contract: the cache covers T-1 tokens, feed the last one
        if self.accepts_full_state:  # the cache after all T tokens: decoding starts from the logits
            kw["full_state"] = True
            pending = []
        res = self.cache.prefill(x, **kw)
        return res.cache, res.logits, pending, (res.reused_tokens, res.recomputed_tokens, res.lost_tokens)

    @torch.no_grad()
    def run(self, req: GenerationRequest, emit: Callable[[str], None], cancelled: Callable[[], bool]) -> Generation:
        """Generate greedily, sending text deltas to ``emit``; stops early when ``cancelled()`` turns true."""
        cache, logits, pending, (reused, recomputed, lost) = self._prefill(req)
        covered = len(req.prompt_ids) - len(pending)  # tokens the cache holds
        reply: list[int] = []
        stream = TextStream(self.tokenizer, req.stops)
        finish = "length"
        while True:
            if cancelled():
                finish = "cancelled"
                break
            token = int(logits.argmax(-1)[0])
            reply.append(token)
            if token in self.eos_ids:
                finish = "stop"
                break
            delta = stream.push(token)
            if delta:
                emit(delta)
            if stream.stopped:
                finish = "stop"
                break
            if len(reply) >= req.max_tokens:
                break
            feed = [*pending, token]
            logits = self._forward(feed, covered, cache)
            covered += len(feed)
            pending = []
        if finish != "cancelled":
            rest = stream.flush()
            if rest:
                emit(rest)
        inserted = False
        if self.cache is not None:
            if finish != "cancelled" and covered > 0:
                # the cache holds prompt + reply but its last token: what the next turn extends
                full = torch.tensor([[*req.prompt_ids, *reply]], device=self.device)
                inserted = bool(self.cache.insert(full, cache, covered=covered))
            self.pinned_nodes = sum(1 for v in self.cache.store.nodes() if v.pins > 0)
        return Generation(
            text=stream.sent,
            finish_reason=finish,
            prompt_tokens=len(req.prompt_ids),
            completion_tokens=len(reply),
            reused_tokens=reused,
            recomputed_tokens=recomputed,
            lost_tokens=lost,
            inserted=inserted,
        )
