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

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum


class Policy(StrEnum):
    """The built-in policies' names (each is a registered :class:`EvictionPolicy` in ``POLICIES``)."""

    LRU = "lru"
    UTILITY = "utility"


@dataclass(frozen=True)
class Unit:
    entry: int  # entry id
    position: int | None  # checkpoint position; None = the whole entry
    nbytes: int  # bytes freed by evicting it
    last_access: int  # logical clock of the last hit that used it (or its creation)
    tokens_saved: float  # expected recompute tokens it saves per future request on its entry × request mass


OrderFn = Callable[[list["Unit"], float, float], list["Unit"]]  # (non-empty units, flops_per_token, alpha)


@dataclass(frozen=True)
class EvictionPolicy:
    """An eviction order: ``order(units, flops_per_token, alpha)`` -> the units, first-to-evict first."""

    name: str
    order: OrderFn
    about: str  # one line for a CLI's choices


POLICIES: dict[str, EvictionPolicy] = {}


def register_policy(policy: EvictionPolicy) -> EvictionPolicy:
    """Add an eviction policy to the registry (a name already taken is refused); returns it."""
    if not isinstance(policy, EvictionPolicy) or not policy.name or policy.name in POLICIES:
        raise ValueError(f"register_policy: {getattr(policy, 'name', policy)!r} is not a new EvictionPolicy name "
                         f"(registered: {', '.join(POLICIES)})")
    POLICIES[policy.name] = policy
    return policy


def unregister_policy(name: str) -> None:
    """Remove a policy (tests registering a toy one)."""
    POLICIES.pop(name, None)


def get_policy(name: str) -> EvictionPolicy:
    """The registered policy called ``name``; an unknown name lists the registry (ValueError)."""
    key = str(name) if isinstance(name, str) else None
    if key is None or key not in POLICIES:
        raise ValueError(f"policy: unknown {name!r}; choose one of {', '.join(POLICIES)}")
    return POLICIES[key]


def policy_names() -> tuple[str, ...]:
    """Registered policy names, in registration order (the CLI's choices)."""
    return tuple(POLICIES)


def _lru(units: list[Unit], flops_per_token: float, alpha: float) -> list[Unit]:
    return sorted(units, key=lambda u: (u.last_access, u.position is None, u.entry))


def _utility(units: list[Unit], flops_per_token: float, alpha: float) -> list[Unit]:
    clocks = [u.last_access for u in units]
    lo, hi = min(clocks), max(clocks)
    eff = [u.tokens_saved * flops_per_token / max(u.nbytes, 1) for u in units]
    top = max(eff) or 1.0

    def score(i: int) -> float:
        recency = 1.0 if hi == lo else (units[i].last_access - lo) / (hi - lo)
        return recency + alpha * eff[i] / top

    order = sorted(range(len(units)), key=lambda i: (score(i), units[i].last_access, units[i].entry))
    return [units[i] for i in order]


register_policy(EvictionPolicy(Policy.LRU.value, _lru, "least recently used first"))
register_policy(EvictionPolicy(Policy.UTILITY.value, _utility,
                               "Marconi-style: recency + alpha x recompute FLOPs saved per byte"))


def eviction_order(units: list[Unit], policy: str, flops_per_token: float, alpha: float = 1.0) -> list[Unit]:
    """Units sorted first-to-evict first, by the registered policy ``policy``."""
    chosen = get_policy(policy)
    if not units:
        return []
    return chosen.order(units, flops_per_token, alpha)
