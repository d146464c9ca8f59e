"""The registry of transfer methods: one object per method, one file each, found by name.

For *Semantic Cache Distillation: Efficient State Transfer via Reuse and Selective Patching*
(``docs/techniques.md#across-models``) and its baselines. Every module in this package that defines
``METHODS`` (a tuple of :class:`~kvstate.transfer.methods.base.TransferMethod` instances) is registered
when the package is first used — adding a method is one new file here plus its test; nothing else names
it. The producer's server (``kvstate transfer serve --method``), the consumer (``generate --method``),
``kvstate transfer bench`` and the TTFT bench reach methods only through :func:`get` / :func:`methods`.
An unknown name is one :class:`MethodError` listing the registry.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from typing import Any

import torch

from kvstate.transfer.methods.base import (
    MethodContext,
    MethodError,
    TransferMethod,
    payload_bytes_per_token,
    producer_states,
    raw_pair,
    shared_prefill,
    tensor_bytes,
)
from kvstate.transfer.payload import Payload
from kvstate.transfer.serving import Receiver

_REGISTRY: dict[str, TransferMethod] = {}
_LOADED = False


def register(method: TransferMethod) -> TransferMethod:
    """Add ``method`` under its name (a second method of the same name is an error)."""
    if not isinstance(method, TransferMethod) or not method.name or not method.name.replace("_", "").isalnum():
        raise MethodError(f"register: {method!r} is not a TransferMethod with a name of letters, digits and _")
    old = _REGISTRY.get(method.name)
    if old is not None and old is not method:
        raise MethodError(f"register: a transfer method named {method.name!r} is already registered "
                          f"({type(old).__module__}); pick another name")
    _REGISTRY[method.name] = method
    return method


def _load() -> None:
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name == "base" or info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        for m in getattr(module, "METHODS", ()):
            register(m)


def methods(shipped_only: bool = False) -> tuple[TransferMethod, ...]:
    """Every registered method in table order (``shipped_only``: those a producer can serve)."""
    _load()
    ms = sorted(_REGISTRY.values(), key=lambda m: (m.order, m.name))
    return tuple(m for m in ms if m.ships_payload or not shipped_only)


def names(shipped_only: bool = False) -> tuple[str, ...]:
    return tuple(m.name for m in methods(shipped_only))


def served_methods() -> tuple[str, ...]:
    """Every method a producer can serve, in table order."""
    return names(shipped_only=True)


def reference() -> str:
    """The name of the method every other is scored and timed against: the one that ships no payload (the
    consumer's own prefill)."""
    refs = [m.name for m in methods() if not m.ships_payload]
    if len(refs) != 1:
        raise MethodError(f"the registry needs exactly one method that ships no payload (the reference), has {refs}")
    return refs[0]


def get(name: str, option: str = "--method", shipped_only: bool = False) -> TransferMethod:
    """The method registered as ``name``; otherwise one :class:`MethodError` listing the registry."""
    _load()
    m = _REGISTRY.get(name) if isinstance(name, str) else None
    if m is None or (shipped_only and not m.ships_payload):
        pick = names(shipped_only)
        what = "is not a transfer method" if m is None else "ships no payload (nothing to serve)"
        raise MethodError(f"{option} {name!r} {what}; pick one of {', '.join(pick)}")
    return m


def parse_options(values: list[str] | tuple[str, ...] | None, option: str = "--option") -> dict[str, str]:
    """``KEY=VALUE`` strings (``--option``, repeatable) -> a dict; a malformed or repeated key is an error."""
    out: dict[str, str] = {}
    for v in values or ():
        key, eq, value = v.partition("=")
        if not eq or not key.strip() or key.strip() in out:
            raise MethodError(f"{option} {v!r} must be KEY=VALUE with each key once, e.g. {option} block=1:4")
        out[key.strip()] = value.strip()
    return out


def context(name: str, ctx: MethodContext, shipped_only: bool = False) -> tuple[TransferMethod, MethodContext]:
    """(the method, its context) with the options checked — the entry point of every command."""
    m = get(name, shipped_only=shipped_only)
    m.check(ctx)
    return m, ctx


def encoder(name: str, producer: Any, ctx: MethodContext) -> tuple[bytes, Callable[[torch.Tensor], Payload]]:
    """(pair, encode ids (1, T) -> payload) of method ``name`` on ``producer``; its fingerprint checked
    against the codec once."""
    m, ctx = context(name, ctx, shipped_only=True)
    ctx.codec.check_models(producer=producer)
    return m.pair(ctx), lambda ids: m.encode(producer, ids, ctx)


def receiver(name: str, consumer: Any, ctx: MethodContext) -> Receiver:
    """How ``consumer`` decodes method ``name``'s payloads; its fingerprint checked against the codec once."""
    m, ctx = context(name, ctx, shipped_only=True)
    ctx.codec.check_models(consumer=consumer)
    return Receiver(m.pair(ctx), lambda payload, ids: m.decode(consumer, payload, ids, ctx))


def describe(ctx: MethodContext | None = None) -> list[dict[str, Any]]:
    """One row per method for listings: name, summary, options, whether it ships a payload, and (given a
    context) the consumer layers it recomputes."""
    return [{"method": m.name, "summary": m.summary, "options": list(m.option_keys), "ships_payload": m.ships_payload,
             **({"recomputed_layers": list(m.recomputed_layers(ctx))} if ctx is not None else {})} for m in methods()]


__all__ = ["MethodContext", "MethodError", "Receiver", "TransferMethod", "context", "describe", "encoder", "get",
           "methods", "names", "parse_options", "payload_bytes_per_token", "producer_states", "raw_pair",
           "receiver", "reference", "register", "served_methods", "shared_prefill", "tensor_bytes"]
