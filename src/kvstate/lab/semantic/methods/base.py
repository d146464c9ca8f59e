"""The per-layer compressed-cache method protocol of the resolution benchmark, and its registry.

Every method the benchmark compares — full KV, SEKV and its ablations, the in-project baselines, whole-cache
KIVI, kvpress presses — is one object registered here by its own module in
:mod:`kvstate.lab.semantic.methods` (one file each; the package imports every module in it, so a new method
is one new file plus its test). Two kinds:

- :class:`Method`, run in this process: ``build`` turns an item's full-resolution prefill (:class:`Prefilled`)
  into a cache holding the context compressed — a :class:`kvstate.semantic.SemanticCache` whose attention
  layers each hold a :class:`LayerStore` (the per-layer protocol: append the fed tokens, attend, count the
  bytes held and read) — or, for the reference, a plain ``DynamicCache``. The benchmark asks each question of
  ``fork(cache)`` inside ``attention(model)`` and reads :meth:`Method.counts`;
- :class:`Adapter`, an external runner owning a family of names (kvpress's presses, run in kvpress's own
  environment): it claims the names it runs and turns them into the same outcome rows.

``role`` tells the report what a row is: the ``reference`` (full KV), the ``proposed`` method (SEKV),
an ``ablation`` of it, or a ``baseline``. :func:`resolve` is the one place a ``--methods`` list is read;
an unknown name is refused with the registry listed. Context: ``docs/techniques.md#resolution``.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Protocol

import torch
from transformers import DynamicCache

from kvstate.errors import KVStateError
from kvstate.semantic.accounting import ByteCounts, evicting_bytes
from kvstate.semantic.attention import semantic_attention
from kvstate.semantic.cache import SemanticCache, surprisal
from kvstate.semantic.config import SLOW_BUDGET, SemanticConfig
from kvstate.semantic.router import SemanticRouter
from kvstate.semantic.segment import SegmentConfig

Role = Literal["reference", "proposed", "ablation", "baseline"]
ROLES = ("reference", "proposed", "ablation", "baseline")


class LayerStore(Protocol):
    """What one compressed attention layer holds (``SemanticLayer.store``): the fed tokens are appended, each
    forward pass attends, and the bytes held and read are counted from its tensors."""

    reads: list[int]  # per pass: K/V bytes materialised and read
    full_at: list[int]  # per pass: full K/V bytes of the tokens seen then
    expanded: list[float]  # per pass: fraction of compressed tokens read at full resolution (may stay empty)

    def append(self, keys: torch.Tensor, values: torch.Tensor, *args: Any) -> None: ...
    def attend(self, query: torch.Tensor, scaling: float, *args: Any) -> torch.Tensor: ...
    def fast_nbytes(self) -> int: ...
    def working_nbytes(self) -> int: ...
    def slow_nbytes(self) -> int: ...
    def full_nbytes(self) -> int: ...


@dataclass(frozen=True)
class SekvOptions:
    """SEKV's settings beside the read budget (the same for every SEKV method of a run)."""

    memory: float | None = None  # bytes held in every tier / full KV; None: the slow tier under slow_budget
    slow: str = "quant"  # "lowrank" or "quant" (sekv_raw: always raw); the default is the headline's 4-bit tier
    bits: int = 4  # slow="quant": 2, 4, 8 or 16


@dataclass(frozen=True)
class Context:
    """The settings every in-process method of one run reads."""

    router: SemanticRouter | None
    segment: SegmentConfig
    expand_share: float = 0.6
    slow_budget: float = SLOW_BUDGET
    options: SekvOptions = field(default_factory=SekvOptions)
    config: SemanticConfig | None = None  # replaces the proposed method's settings (e.g. the zoom="all" oracle)


@dataclass(frozen=True)
class Prefilled:
    """One item's context prefilled once at full resolution; every method and budget compresses a copy."""

    cache: Any  # DynamicCache(config=model.config) holding the context (never fed afterwards)
    surprisal: torch.Tensor  # (T,) -log p(x_t | x_<t) of each context token, from the prefill logits


@torch.no_grad()
def prefill(model: Any, context: list[int]) -> Prefilled:
    """Prefill ``context`` once (the forward pass every method starts from)."""
    ctx = torch.tensor([context])
    cache = DynamicCache(config=model.config)
    logits = model(input_ids=ctx, position_ids=torch.arange(ctx.shape[1])[None], cache=cache, use_cache=True).logits
    return Prefilled(cache, surprisal(logits, ctx))


class Method:
    """An in-process method. Subclasses set ``name`` / ``role`` / ``about`` and implement :meth:`build`; the
    defaults fit a compressed :class:`~kvstate.semantic.SemanticCache`."""

    name: ClassVar[str]
    role: ClassVar[Role] = "baseline"
    about: ClassVar[str] = ""  # one line for --methods and the report

    def config(self, budget: float, ctx: Context) -> SemanticConfig | None:
        """The cache settings at ``budget`` (None: the method has none)."""
        return None

    def build(self, model: Any, tokenizer: Any, context: list[int], budget: float, ctx: Context,
              pre: Prefilled) -> Any:
        """A cache holding ``context`` compressed from ``pre`` (left unchanged)."""
        raise NotImplementedError

    def budgets(self, budgets: Sequence[float]) -> list[float]:
        """The budgets this method runs at, given the run's."""
        return list(budgets)

    def share_key(self, budget: float, ctx: Context) -> Hashable | None:
        """Runs of one item with equal keys share one compression (None: never shared)."""
        return None

    def fork(self, cache: Any, budget: float, ctx: Context) -> Any:
        """An independent copy of ``cache`` to answer one question with (decoding settings may differ)."""
        return cache.fork()

    def attention(self, model: Any) -> contextlib.AbstractContextManager[Any]:
        """The attention function a compressed cache needs while decoding."""
        return semantic_attention(model)

    def counts(self, cache: Any) -> tuple[ByteCounts, float]:
        """Byte counts after an answer and the peak read ratio (K/V read / full K/V, over the passes)."""
        ratios = cache.read_ratios()
        return cache.byte_counts(), max(ratios) if ratios else 0.0

    def expanded(self, cache: Any) -> float | None:
        """Mean fraction of compressed tokens read at full resolution (None: the method reads none back)."""
        return None

    def slow_log(self, cache: Any) -> dict[str, Any] | None:
        """The slow tier against its budget after compression (None: no budgeted slow tier)."""
        return None


class StoreMethod(Method):
    """A method whose cache is a :class:`~kvstate.semantic.SemanticCache` (subclass ``cache_class``) adopting the
    prefill and compressing it: :meth:`config` gives its settings, :meth:`compress` compresses."""

    cache_class: ClassVar[type] = SemanticCache

    def router(self, ctx: Context) -> SemanticRouter | None:
        return None

    def build(self, model: Any, tokenizer: Any, context: list[int], budget: float, ctx: Context,
              pre: Prefilled) -> Any:
        cache = self.cache_class(model, self.router(ctx), self.config(budget, ctx))
        cache.adopt(pre.cache)
        self.compress(cache, tokenizer, context, pre)
        return cache

    def compress(self, cache: Any, tokenizer: Any, context: list[int], pre: Prefilled) -> None:
        cache.compress()


class Uncompressed(Method):
    """The reference: the full cache, answered on a deep copy with the model's own attention."""

    role: ClassVar[Role] = "reference"

    def build(self, model: Any, tokenizer: Any, context: list[int], budget: float, ctx: Context,
              pre: Prefilled) -> Any:
        return copy.deepcopy(pre.cache)

    def budgets(self, budgets: Sequence[float]) -> list[float]:
        return [1.0]

    def fork(self, cache: Any, budget: float, ctx: Context) -> Any:
        return copy.deepcopy(cache)

    def attention(self, model: Any) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def counts(self, cache: Any) -> tuple[ByteCounts, float]:
        return evicting_bytes(cache, cache.get_seq_length()), 1.0


class Adapter:
    """An external runner owning a family of method names (e.g. kvpress's presses)."""

    name: ClassVar[str]
    role: ClassVar[Role] = "baseline"
    about: ClassVar[str] = ""

    def claims(self, name: str) -> list[str] | None:
        """The runner's names ``name`` stands for (None: not this adapter's)."""
        raise NotImplementedError

    def owns_result(self, name: str) -> bool:
        """Whether a result row's method ``name`` came from this adapter."""
        raise NotImplementedError

    def run(self, model_dir: Any, items: Sequence[Any], names: Sequence[str], budgets: Sequence[float],
            threads: int, journal: Any, progress: Callable[[int], None] | None,
            note: Callable[[str], None]) -> tuple[list[Any], list[dict[str, Any]], dict[str, Any]]:
        """(outcomes, not-run entries, info for the result file) of ``names`` at ``budgets`` on ``items``."""
        raise NotImplementedError


METHODS: dict[str, Method] = {}
ADAPTERS: dict[str, Adapter] = {}


def register(entry: Method | Adapter) -> None:
    """Add a method or adapter under its name (once; a name is unique across both)."""
    name = getattr(entry, "name", None)
    if not isinstance(name, str) or not name or name in METHODS or name in ADAPTERS:
        raise KVStateError(f"register: {type(entry).__name__} needs a unique name, got {name!r}")
    if entry.role not in ROLES:
        raise KVStateError(f"register: {name!r} has role {entry.role!r}; choose from {ROLES}")
    if isinstance(entry, Adapter):
        ADAPTERS[name] = entry
    else:
        METHODS[name] = entry


def unregister(name: str) -> None:
    """Remove a registered name (tests that register a toy method)."""
    METHODS.pop(name, None)
    ADAPTERS.pop(name, None)


def listing() -> str:
    """Every registered name, in-process methods first, for help texts and errors."""
    return ", ".join([*METHODS, *(f"{a} (or its names)" for a in ADAPTERS)])


def get(name: str) -> Method:
    """The in-process method ``name``; an unknown name is one error listing the registry."""
    if name not in METHODS:
        raise ValueError(f"unknown in-process method {name!r}; choose from {', '.join(METHODS)}")
    return METHODS[name]


@dataclass(frozen=True)
class Selection:
    """A ``--methods`` list resolved: in-process method names, and per adapter the names it runs."""

    methods: list[str]
    external: dict[str, list[str]]


def resolve(names: Sequence[str]) -> Selection:
    """Resolve ``--methods``: registered methods as they are, anything else by the adapter that claims it;
    an unknown name or a name given twice is refused with the registry listed."""
    methods: list[str] = []
    external: dict[str, list[str]] = {}
    unknown = []
    for n in names:
        if n in METHODS:
            if n not in methods:
                methods.append(n)
            continue
        for a in ADAPTERS.values():
            got = a.claims(n)
            if got is not None:
                have = external.setdefault(a.name, [])
                twice = [x for x in got if x in have]
                if twice:
                    raise KVStateError(f"--methods names {', '.join(twice)} twice (through {n!r}); list each once")
                have += got
                break
        else:
            unknown.append(n)
    if unknown:
        raise KVStateError(f"--methods: unknown method(s) {unknown}; choose from {listing()}, "
                           "e.g. --methods full,sekv,SnapKVPress")
    return Selection(methods, external)


def role(name: str) -> Role:
    """The role of a result row's method (a row an adapter wrote: that adapter's role)."""
    if name in METHODS:
        return METHODS[name].role
    for a in ADAPTERS.values():
        if a.owns_result(name):
            return a.role
    return "baseline"


def names_with_role(r: Role) -> list[str]:
    return [n for n, m in METHODS.items() if m.role == r]


def reference() -> str:
    """The name of the reference method (the full cache)."""
    ref = names_with_role("reference")
    if len(ref) != 1:
        raise KVStateError(f"the registry holds {len(ref)} reference methods; exactly one is the full cache")
    return ref[0]
