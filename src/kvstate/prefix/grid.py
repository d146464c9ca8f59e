"""Grid checkpoints for a prefix's first sighting: recurrent states on a coarse block grid (pure; no torch).

Sparse prefix caching ("Sparse Prefix Caching for Hybrid and Recurrent LLM Serving") places recurrent
checkpoints where the observed overlap depths say (:mod:`kvstate.prefix.placement`). A prefix seen once has
no statistics yet, so the next request that shares it and diverges after it finds no state at or before its
divergence point and recomputes the whole prefix. Block-aligned hybrid prefix caching keeps the recurrent
state on a block grid instead, so a hit resumes at the last block boundary it reaches (vLLM: "Mamba state is
stored only on the Mamba block grid", https://docs.vllm.ai/en/latest/features/automatic_prefix_caching/);
Marconi ("Marconi: Prefix Caching for the Era of Hybrid LLMs", Pan et al., MLSys 2025,
https://arxiv.org/abs/2411.19379) shows why checkpointing every position cannot pay: the states are large
and most are never reused.

Here the grid is a fallback for first sightings under its own byte share: during a prefill the engine also
captures the state at every multiple of ``block`` it computes (the same forward pass, calls end there), so a
later request that diverges anywhere restores at most one block back; grid states beyond the share evict
the least recently used grid states first. Once requests have overlapped a path (statistics arrived), the
exact placement decides: a grid state on that path that the request's plan does not keep and that did not
serve it is dropped after ``thin_after`` observed overlaps there. Ignored: declared boundaries (they are
captured as before; the grid adds to them), the shared tier (grid states are written only locally).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvstate.errors import KVStateError
from kvstate.validate import check_float, check_int

DEFAULT_BLOCK = 256  # tokens between grid states (measured: docs/results/prefix_second_visit.json)


@dataclass(frozen=True)
class GridConfig:
    # tokens between grid checkpoints (rounded down to a multiple of the engine's align, at least one align);
    # 0 turns the grid off
    block: int = DEFAULT_BLOCK
    budget_share: float = 0.25  # the share of the prefix cache's byte budget grid states may hold
    # observed overlaps on a path after which its grid states the exact plan does not keep are dropped (0: never)
    thin_after: int = 2

    def __post_init__(self) -> None:
        check_int("block", self.block, 0, 2**31 - 1, error=KVStateError, hint="; 0 turns the grid off")
        check_float("budget_share", self.budget_share, 0.0, 1.0, error=KVStateError,
                    hint="; the share of the prefix cache's byte budget grid checkpoints may hold")
        check_int("thin_after", self.thin_after, 0, 2**31 - 1, error=KVStateError, hint="; 0 never thins")

    @property
    def enabled(self) -> bool:
        return self.block > 0 and self.budget_share > 0


def grid_step(block: int, align: int) -> int:
    """The grid's spacing on an engine whose checkpoints sit on multiples of ``align``: ``block`` rounded
    down to a multiple of ``align``, at least ``align`` (a cut off the model's chunk grid would change its
    chunked kernels' rounding)."""
    return max(align, block // align * align)


def grid_positions(start: int, end: int, step: int) -> list[int]:
    """Multiples of ``step`` strictly between ``start`` (the resume point) and ``end`` (the end state)."""
    first = (start // step + 1) * step
    return list(range(first, end, step)) if step > 0 else []


def affordable(candidates: Sequence[int], each: int, held: int, budget: int) -> list[int]:
    """The shallowest of ``candidates`` that fit beside ``held`` grid bytes in ``budget`` (``each`` bytes
    apiece): a shallower grid state serves every request diverging past it."""
    room = (budget - held) // each if each > 0 else len(candidates)
    return sorted(candidates)[: max(room, 0)]


def to_thin(
    grid: Iterable[int], plan: Iterable[int], restored: int, observed: Iterable[tuple[int, float]], thin_after: int
) -> list[int]:
    """Grid positions to drop after a request: those with at least ``thin_after`` observed overlaps where they
    sit (``observed``: ``(position, count)`` for each grid state on the request's shared path) that its
    exact plan does not keep and that it did not restore from."""
    if thin_after <= 0:
        return []
    keep = set(plan) | {restored}
    seen = dict(observed)
    return sorted(p for p in grid if p not in keep and seen.get(p, 0.0) >= thin_after)


@dataclass
class GridEntry:
    tokens: tuple[int, ...]  # a request's tokens; the state covers the first `position`
    position: int
    nbytes: int


class GridLedger:
    """The grid states the store holds now, keyed by their token path, and their bytes. The store tells it
    what it stores and evicts (its observer); the engine registers a grid capture just before committing it."""

    def __init__(self) -> None:
        self._held: dict[int, list[GridEntry]] = {}  # hash(token path) -> entries (a list: hash collisions)
        self._pending: dict[int, list[GridEntry]] = {}
        self.nbytes = 0

    def __len__(self) -> int:
        return sum(len(v) for v in self._held.values())

    def expect(self, tokens: tuple[int, ...], sizes: dict[int, int]) -> None:
        """Grid states of ``tokens`` about to be committed (``{position: bytes}``)."""
        for p, nb in sizes.items():
            self._pending.setdefault(hash(tokens[:p]), []).append(GridEntry(tokens, p, nb))

    def settle(self) -> None:
        """After the commit: what it did not store is no grid state."""
        self._pending.clear()

    def heard(self, event: str, kind: str, tokens: tuple[int, ...]) -> None:
        """The store's observer: a state stored or evicted after ``tokens``."""
        if kind != "state":
            return
        key = hash(tokens)
        if event == "stored":
            for e in self._pending.get(key, []):
                if e.tokens[: e.position] == tokens:
                    self._held.setdefault(key, []).append(e)
                    self.nbytes += e.nbytes
                    self._pending[key].remove(e)
                    return
        elif event == "evicted":
            for e in self._held.get(key, []):
                if e.tokens[: e.position] == tokens:
                    self._held[key].remove(e)
                    if not self._held[key]:
                        del self._held[key]
                    self.nbytes -= e.nbytes
                    return

    def entries(self) -> list[GridEntry]:
        return [e for v in self._held.values() for e in v]

    def held_at(self, tokens: tuple[int, ...], positions: Iterable[int]) -> list[int]:
        """Those of ``positions`` where a grid state on the path of ``tokens`` is held."""
        out = []
        for p in positions:
            if any(e.position == p and e.tokens[:p] == tokens[:p] for e in self._held.get(hash(tokens[:p]), [])):
                out.append(p)
        return out
