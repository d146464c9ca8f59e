"""Greedy replies from a cache prefilled (and perhaps changed) before the reply starts.

The lab's item-major experiments that transform a cache after the prefill (raw reuse of another model's cache, a
cross-layer low-rank reconstruction) share one prefill per item: :func:`prefill` fills a ``DynamicCache`` with
the prompt less its last token, the experiment changes (a copy of) it, and :func:`reply_from` feeds the last
prompt token through it and decodes greedily with ``generate``.
"""

from __future__ import annotations

import copy
from typing import Any

import torch


@torch.no_grad()
def prefill(model: Any, ids: torch.Tensor) -> Any:
    """A ``DynamicCache`` holding ``ids`` (1, T) less its last token."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    model(ids[:, :-1], cache=cache, use_cache=True)
    return cache


@torch.no_grad()
def reply_from(model: Any, tok: Any, ids: torch.Tensor, cache: Any, new_tokens: int) -> str:
    """Greedy reply of ``model`` to ``ids`` whose first ``T - 1`` tokens are in ``cache`` (a copy is used)."""
    out = model.generate(ids, attention_mask=torch.ones_like(ids), cache=copy.deepcopy(cache),
                         max_new_tokens=new_tokens, do_sample=False, pad_token_id=tok.eos_token_id)
    return str(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))


__all__ = ["prefill", "reply_from"]
