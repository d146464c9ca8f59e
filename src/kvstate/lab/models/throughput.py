"""How fast the real model runs here: prefill and decode tokens/s per context length, and fine-tuning tokens/s.

Every later run on the real model is sized from these numbers (the brief: ~30x the toy's compute per token).
One thread (the lab runs each job on one), fp32, batch 1. Prefill: one forward over ``L`` random token ids into
an empty ``DynamicCache``. Decode: after that prefill, ``decode_tokens`` single-token forwards through the
cache (what ``generate`` does per step, without sampling). Fine-tuning: one AdamW step (forward, backward,
update) on ``train_length`` tokens, in fp32 and under ``torch.autocast("cpu", bfloat16)`` (the weights and the
optimizer stay fp32; matmuls run in bf16 where the CPU has bf16 instructions), the two interleaved in every round.
Every measurement is repeated ``repeats`` times, interleaved over the lengths (round r times every length before
round r + 1), and reported as the median with its min / max.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers import DynamicCache


def _timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _summary(tokens: int, seconds: list[float]) -> dict[str, Any]:
    rates = sorted(tokens / s for s in seconds)
    return {"tok_s": round(statistics.median(rates), 2), "tok_s_range": [round(rates[0], 2), round(rates[-1], 2)],
            "seconds": [round(s, 4) for s in seconds]}


def measure(model: Any, lengths: Sequence[int], *, decode_tokens: int = 32, repeats: int = 5, train_length: int = 512,
            seed: int = 0, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """``{"prefill": [row per length], "decode": [row per length], "train": row}`` (see the module docstring)."""
    g = torch.Generator().manual_seed(seed)
    vocab = int(model.config.vocab_size)
    ids = {n: torch.randint(0, vocab, (1, n), generator=g) for n in lengths}
    prefill: dict[int, list[float]] = {n: [] for n in lengths}
    decode: dict[int, list[float]] = {n: [] for n in lengths}
    model.eval()
    for r in range(repeats):
        for n in lengths:
            with torch.no_grad():
                cache = DynamicCache(config=model.config)
                prefill[n].append(_timed(lambda n=n, cache=cache: model(ids[n], cache=cache, use_cache=True)))
                nxt = ids[n][:, -1:]

                def steps(cache: Any = cache, nxt: torch.Tensor = nxt) -> None:
                    tok = nxt
                    for _ in range(decode_tokens):
                        tok = model(tok, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)

                decode[n].append(_timed(steps))
            if progress:
                progress(f"round {r + 1}/{repeats}, {n:,} tokens: prefill {prefill[n][-1]:.2f} s, "
                         f"{decode_tokens} decode steps {decode[n][-1]:.2f} s")
    train: list[float] = []
    train_bf16: list[float] = []
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    batch = torch.randint(0, vocab, (1, train_length), generator=g)

    def step(bf16: bool) -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(batch, labels=batch).loss
        loss.backward()
        opt.step()

    for r in range(repeats):
        for bf16, into in ((False, train), (True, train_bf16)) if r % 2 == 0 else ((True, train_bf16), (False, train)):
            into.append(_timed(lambda bf16=bf16: step(bf16)))
        if progress:
            progress(f"round {r + 1}/{repeats}, fine-tuning step on {train_length} tokens: fp32 {train[-1]:.2f} s, "
                     f"bf16 autocast {train_bf16[-1]:.2f} s")
    model.eval()
    return {"prefill": [{"length": n, **_summary(n, prefill[n])} for n in lengths],
            "decode": [{"context": n, "new_tokens": decode_tokens, **_summary(decode_tokens, decode[n])}
                       for n in lengths],
            "train": {"length": train_length, "optimizer": "AdamW", **_summary(train_length, train)},
            "train_bf16_autocast": {"length": train_length, "optimizer": "AdamW",
                                    **_summary(train_length, train_bf16)}}
