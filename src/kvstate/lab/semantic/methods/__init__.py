"""The resolution benchmark's methods, one module each, registered in :mod:`~kvstate.lab.semantic.methods.base`.

Importing this package imports every module in it, and each registers its method (or adapter) by name:
``full``, ``sekv`` and its ablations, ``sentencekv``, ``quest``, ``streaming`` / ``window``, ``kivi`` and
the ``kvpress`` adapter. A new method is one new module here plus its test; ``kvstate semantic eval
--methods`` lists whatever is registered.
"""

from __future__ import annotations

import importlib
import pkgutil

from kvstate.lab.semantic.methods.base import (
    ADAPTERS,
    METHODS,
    ROLES,
    Adapter,
    Context,
    LayerStore,
    Method,
    Prefilled,
    SekvOptions,
    Selection,
    get,
    listing,
    names_with_role,
    prefill,
    reference,
    register,
    resolve,
    role,
    unregister,
)

for _m in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    if _m.name != "base":
        importlib.import_module(f"{__name__}.{_m.name}")
# listed by role (the reference, the proposed method, its ablations, the baselines), then as registered
_order = sorted(METHODS.items(), key=lambda kv: ROLES.index(kv[1].role))
METHODS.clear()
METHODS.update(_order)

__all__ = ["ADAPTERS", "METHODS", "Adapter", "Context", "LayerStore", "Method", "Prefilled", "SekvOptions",
           "Selection", "get", "listing", "names_with_role", "prefill", "reference", "register", "resolve", "role", "unregister"]
