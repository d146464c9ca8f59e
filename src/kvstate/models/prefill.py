"""Segmented prefill: run a prompt through a model in segments ending at given cut positions.

Only the final recurrent state of a forward call exists (sparse prefix caching; docs/techniques.md), so a checkpoint at
``c`` needs a call boundary at ``c``. This module makes those boundaries, always with explicit
``position_ids`` (Bamba and pure-SSM caches go wrong without them), and snapshots the state at each
cut. Resuming from a restored snapshot and running the same remaining segments reproduces the
uninterrupted segmented computation bit for bit. ``chunk`` adds call boundaries every ``chunk`` tokens and
``between`` runs after each call but the last: a server decodes its running batch there, so a long
prompt holds the others up for one chunk at a time (chunked prefill).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from transformers import DynamicCache

from kvstate.errors import KVStateError
from kvstate.models.families import layer_kinds
from kvstate.models.state import CacheSnapshot, snapshot_cache

Capture = Literal["full", "recurrent"]


@dataclass
class PrefillOutput:
    logits: torch.Tensor  # (B, V) logits of the last position, or (B, T_new, V) with all_logits
    cache: DynamicCache  # live cache after the last token
    snapshots: dict[int, CacheSnapshot] = field(default_factory=dict)  # position → state at that cut


def validate_cuts(cuts: Iterable[int], start: int, end: int) -> list[int]:
    out = sorted(set(int(c) for c in cuts))
    bad = [c for c in out if not start < c <= end]
    if bad:
        raise KVStateError(f"cut positions {bad} are outside ({start}, {end}]; cuts must lie inside the new tokens.")
    return out


@torch.no_grad()
def segmented_prefill(
    model: Any,
    input_ids: torch.Tensor,
    cuts: Iterable[int] = (),
    *,
    cache: DynamicCache | None = None,
    start: int = 0,
    capture: Capture | None = "full",
    all_logits: bool = False,
    chunk: int | None = None,
    between: Callable[[], None] | None = None,
) -> PrefillOutput:
    """Feed ``input_ids[:, start:]`` into ``cache`` (which already holds ``start`` tokens).

    ``cuts`` are absolute positions in ``(start, T]`` where a forward call ends; with ``capture`` set the
    state at each cut is snapshotted (``"recurrent"`` keeps only recurrent parts: a sparse checkpoint).
    ``chunk``: no forward call covers more than this many tokens (extra boundaries, not snapshotted);
    ``between``: called after every forward call but the last.
    """
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise KVStateError(f"chunk={chunk!r} must be a positive int (tokens per forward call) or None.")
    if input_ids.dim() != 2:
        raise KVStateError(f"input_ids must be (batch, seq), got shape {tuple(input_ids.shape)}.")
    total = int(input_ids.shape[1])
    if not 0 <= start < total:
        raise KVStateError(f"start={start} must be in [0, {total}) — nothing new to prefill otherwise.")
    kinds = layer_kinds(model.config)
    if cache is None:
        if start:
            raise KVStateError(f"start={start} needs a cache holding those {start} tokens; pass cache=.")
        cache = DynamicCache(config=model.config)
    wanted = validate_cuts(cuts, start, total)
    bounds = sorted(set(wanted) | {total} | (set(range(start + chunk, total, chunk)) if chunk else set()))
    snapshots: dict[int, CacheSnapshot] = {}
    pieces: list[torch.Tensor] = []
    prev = start
    device = input_ids.device
    for cut in bounds:
        ids = input_ids[:, prev:cut]  # (B, cut - prev)
        positions = torch.arange(prev, cut, device=device).unsqueeze(0).expand(ids.shape[0], -1)
        out = model(
            input_ids=ids,
            position_ids=positions,
            cache=cache,
            use_cache=True,
            logits_to_keep=0 if all_logits else 1,
        )
        pieces.append(out.logits if all_logits else out.logits[:, -1])
        if capture is not None and cut in wanted:
            # "recurrent": the checkpoint part only, without cloning the attention KV
            snapshots[cut] = snapshot_cache(cache, cut, kinds, attention=capture != "recurrent")
        prev = cut
        if between is not None and cut != total:
            between()
    logits = torch.cat(pieces, dim=1) if all_logits else pieces[-1]
    return PrefillOutput(logits=logits, cache=cache, snapshots=snapshots)

