"""Generation for one request at a time or many in a batch, with the sparse prefix cache under it (or none).

A request is prefilled through :meth:`SparsePrefixCache.prefill` (resume from the deepest stored state,
compute the suffix, capture the planned checkpoints and the message ends as declared checkpoints;
``full_state=True``: the cache after the whole prompt; ``chunk`` / ``between``: in chunks, with the running
batch decoded between them), then decoded one token per step with explicit positions. :class:`Decoding` is
one request's side of that: it chooses each token from the step's logits (:class:`~kvstate.serve.sampling.Sampler`:
greedy, or temperature / top-k / top-p with a per-request seed, repetition penalty, ``min_tokens``,
``ignore_eos``, logprobs), streams the text (stop strings held back), and decides when the reply ends.
The decode steps themselves are either this request's alone (:meth:`Generator.run`) or one row of a
:class:`~kvstate.serve.batching.DecodeBatch` (the batching scheduler, :mod:`kvstate.serve.scheduler`).

When a reply is complete, prompt + reply is inserted into the cache (``insert``: the state after every
token but the last, exactly what the next turn's prompt extends). A cancelled request (a client that went
away) stops at its next step and inserts nothing; what its prefill pinned was released when the prefill
committed. Without a cache the prompt is prefilled by the same chunked calls and the decode loop is the
same, so greedy replies agree up to floating-point noise.

A request that sets no sampling fields follows the model's ``generation_config`` (greedy unless it says
``do_sample=True``, with its temperature / top-k / top-p), as transformers' ``generate`` would.
Runs on the server's worker thread: the model and the cache are used from that thread only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvstate.models import ResumableCache, segmented_prefill
from kvstate.models.decode import forward_at
from kvstate.models.families import text_config
from kvstate.serve.sampling import Sampler, SamplingParams
from kvstate.serve.text import TextStream


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: tuple[int, ...]
    max_tokens: int  # reply tokens at most (the end-of-sequence token counts)
    stops: tuple[str, ...] = ()  # the reply ends before the first of these strings
    boundaries: tuple[int, ...] = ()  # message-end positions to checkpoint (chat), in (0, len - 1)
    sampling: SamplingParams | None = None  # None: the model's generation_config (greedy by default)
    skip_special_tokens: bool = True  # special tokens are left out of the reply's text


@dataclass(frozen=True)
class Delta:
    """Text that can be sent now, and how many reply tokens produced the text sent so far."""

    text: str
    completion_tokens: int


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float  # the model's raw log-probability of the token
    top: tuple[tuple[int, float], ...]  # the most likely tokens at this step (as many as asked)


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
    seed: int | None = None  # the seed the reply was sampled with (None: greedy)
    logprobs: tuple[TokenLogprob, ...] = ()  # per reply token, when asked for
    reply_ids: tuple[int, ...] = field(default=(), repr=False)  # the generated token ids


@dataclass
class Prefilled:
    cache: Any  # holds every prompt token
    logits: torch.Tensor  # (V,) of the last prompt position
    reused: int
    recomputed: int
    lost: int


class Decoding:
    """One request's decoding state: feed it each step's logits with :meth:`take` until it returns False."""

    def __init__(self, gen: Generator, req: GenerationRequest, emit: Callable[[Delta], None],
                 cancelled: Callable[[], bool]) -> None:
        self.req = req
        self.emit = emit
        self.cancelled = cancelled
        self.sampler = Sampler(req.sampling or gen.default_sampling, req.prompt_ids, gen.eos_ids)
        self.stream = TextStream(gen.tokenizer, req.stops, skip_special_tokens=req.skip_special_tokens)
        self.reply: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.finish = "length"
        self.covered = 0  # tokens the request's cache holds (set after its prefill)
        self.prefill: Prefilled | None = None

    @property
    def next_token(self) -> int:
        """The token to feed at position ``covered`` (the last one chosen)."""
        return self.reply[-1]

    def take(self, logits: torch.Tensor) -> bool:
        """Choose the next token from ``logits`` (V,), stream its text; False when the reply is over."""
        if self.cancelled():
            self.finish = "cancelled"
            return False
        token, logprob, top = self.sampler.next(logits, self.reply)
        self.reply.append(token)
        if self.sampler.params.logprobs is not None:
            self.logprobs.append(TokenLogprob(token, logprob, tuple(top)))
        if self.sampler.stops_at(token):
            self.finish = "stop"
            return False
        delta = self.stream.push(token)
        if delta:
            self.emit(Delta(delta, len(self.reply)))
        if self.stream.stopped:
            self.finish = "stop"
            return False
        return len(self.reply) < self.req.max_tokens

    def close(self, inserted: bool) -> Generation:
        """Flush the held-back text and describe the reply."""
        if self.finish != "cancelled":
            rest = self.stream.flush()
            if rest:
                self.emit(Delta(rest, len(self.reply)))
        p = self.prefill
        reused, recomputed, lost = (p.reused, p.recomputed, p.lost) if p is not None else (0, 0, 0)
        return Generation(
            text=self.stream.sent,
            finish_reason=self.finish,
            prompt_tokens=len(self.req.prompt_ids),
            completion_tokens=len(self.reply),
            reused_tokens=reused,
            recomputed_tokens=recomputed,
            lost_tokens=lost,
            inserted=inserted,
            seed=None if self.sampler.params.greedy else self.sampler.seed,
            logprobs=tuple(self.logprobs),
            reply_ids=tuple(self.reply),
        )


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
        self.default_sampling = self._default_sampling()
        self.accepts_boundaries = cache is not None
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

    def _default_sampling(self) -> SamplingParams:
        """What a request that sets no sampling field gets: the model's generation_config, as ``generate``."""
        gc = getattr(self.model, "generation_config", None)
        if gc is None or not getattr(gc, "do_sample", False):
            return SamplingParams(temperature=0.0)
        return SamplingParams(temperature=float(gc.temperature if gc.temperature is not None else 1.0),
                              top_p=float(gc.top_p if gc.top_p is not None else 1.0),
                              top_k=int(gc.top_k or 0))

    def request_bytes(self, tokens: int) -> int:
        """Bytes the prefix cache would hold for a request of ``tokens`` tokens (KV + one state + logits)."""
        if self.cache is None:
            return 0
        sc = self.cache.store.config
        return int(tokens * sc.kv_bytes_per_token + sc.checkpoint_bytes + sc.logits_bytes)

    def _forward(self, ids: list[int], start: int, cache: Any) -> torch.Tensor:
        """Feed ``ids`` at positions ``start..``; the last position's logits ``(1, V)`` (the one decode step,
        :func:`kvstate.models.decode.forward_at`)."""
        return forward_at(self.model, cache, ids, start, last_only=True, device=self.device)

    def cached_tokens(self, prompt_ids: Sequence[int]) -> int:
        """Prompt tokens the prefix cache would restore for this prompt (0 without a cache)."""
        return 0 if self.cache is None else int(self.cache.computed_tokens(prompt_ids))

    def begin(self, req: GenerationRequest, emit: Callable[[Delta], None], cancelled: Callable[[], bool]) -> Decoding:
        return Decoding(self, req, emit, cancelled)

    @torch.no_grad()
    def prefill(self, d: Decoding, chunk: int | None = None, between: Callable[[], None] | None = None) -> Prefilled:
        """The cache after every prompt token and the last position's logits; in forward calls of at most
        ``chunk`` tokens with ``between()`` after each but the last."""
        ids = list(d.req.prompt_ids)
        x = torch.tensor([ids], device=self.device)  # (1, T)
        if self.cache is None:
            cache = ResumableCache(self.model.config)
            out = segmented_prefill(self.model, x, cache=cache, capture=None, chunk=chunk, between=between)
            p = Prefilled(cache.seal(len(ids)), out.logits[0], 0, len(ids), 0)
        else:
            kw: dict[str, Any] = {"boundaries": list(d.req.boundaries)} if d.req.boundaries else {}
            res = self.cache.prefill(x, full_state=True, chunk=chunk, between=between, **kw)
            p = Prefilled(res.cache, res.logits[0], res.reused_tokens, res.recomputed_tokens, res.lost_tokens)
        d.prefill, d.covered = p, len(ids)
        return p

    def finish(self, d: Decoding, cache: Any) -> Generation:
        """Insert prompt + reply (``cache`` holds all of it but the last token) unless cancelled; the result."""
        inserted = False
        if self.cache is not None:
            if d.finish != "cancelled" and d.covered > 0 and cache is not None:
                full = torch.tensor([[*d.req.prompt_ids, *d.reply]], device=self.device)
                inserted = bool(self.cache.insert(full, cache, covered=d.covered))
            self.pinned_nodes = sum(1 for v in self.cache.store.nodes() if v.pins > 0)
        return d.close(inserted)

    @torch.no_grad()
    def run(self, req: GenerationRequest, emit: Callable[[Delta], None], cancelled: Callable[[], bool]) -> Generation:
        """One request alone: prefill, then decode until the reply ends (``cancelled()``: at the next token)."""
        d = self.begin(req, emit, cancelled)
        p = self.prefill(d)
        cache, logits = p.cache, p.logits
        while d.take(logits):
            logits = self._forward([d.next_token], d.covered, cache)[0]
            d.covered += 1
        return self.finish(d, cache)
