"""Eviction order for the sparse prefix store under a byte budget (pure; no torch).

Two policies over *units* — a whole entry (its attention KV, final state and checkpoints) or one sparse
recurrent checkpoint of an entry — so checkpoints and KV evict separately (the sparse prefix caching paper keeps placement
inside an entry; admission/eviction across entries is the Marconi axis it names as future work):

- ``lru``: the least recently used unit first.
- ``utility``: Marconi-style score = recency + alpha · (recompute FLOPs saved per byte), both normalised
  to [0, 1] over the candidates; lowest score first. Written from the paper's description (its code is
  under a non-commercial licence and is not used).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Policy(StrEnum):
    LRU = "lru"
    UTILITY = "utility"


@dataclass(frozen=True)
class Unit:
    entry: int  # entry id
    position: int | None  # checkpoint position; None = the whole entry
    nbytes: int  # bytes freed by evicting it
    last_access: int  # logical clock of the last hit that used it (or its creation)
    tokens_saved: float  # expected recompute tokens it saves per future request on its entry × request mass


def eviction_order(units: list[Unit], policy: Policy, flops_per_token: float, alpha: float = 1.0) -> list[Unit]:
    """Units sorted first-to-evict first."""
    if not units:
        return []
    if policy is Policy.LRU:
        return sorted(units, key=lambda u: (u.last_access, u.position is None, u.entry))
    clocks = [u.last_access for u in units]
    lo, hi = min(clocks), max(clocks)
    eff = [u.tokens_saved * flops_per_token / max(u.nbytes, 1) for u in units]
    top = max(eff) or 1.0

    def score(i: int) -> float:
        recency = 1.0 if hi == lo else (units[i].last_access - lo) / (hi - lo)
        return recency + alpha * eff[i] / top

    order = sorted(range(len(units)), key=lambda i: (score(i), units[i].last_access, units[i].entry))
    return [units[i] for i in order]
