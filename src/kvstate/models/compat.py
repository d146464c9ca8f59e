"""The one home of every transformers internal kvstate reaches past the public API.

kvstate works over transformers' unified ``DynamicCache`` and its model families' own code: it snapshots
cache layers (``DynamicLayer`` / ``LinearAttentionCacheLayerMixin`` / ``DummyLayer`` attributes), installs
attention functions (``ALL_ATTENTION_FUNCTIONS``, ``sdpa_attention_forward``, ``sdpa_mask``), rotates with a
family's own ``apply_rotary_pos_emb`` / ``rotate_half``, and reads the Gated-DeltaNet chunk length from the
torch fallback kernel that runs. None of that is a public contract: a release may move or wrap any of it
(transformers 5.25 wrapped the Gated-DeltaNet kernels in a kernels-hub ``Func`` module, so the kernel's
signature became ``(*args, **kwargs)``). Every such reach goes through this module, and
:func:`check_internals` lists each one that no longer holds as one line naming the transformers version and
the internal — ``tests/lib/models/test_compat.py`` runs it, and ``make canary`` runs it on the newest release.

``TESTED`` is the range of transformers releases the canary has passed (``docs/results/compat.json``); a
version outside it warns once at import (a library user may know better) and names ``make canary``.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
import transformers

from kvstate.errors import KVStateError

# the transformers releases the canary has passed (inclusive bounds, major.minor); pyproject's bounds follow it
TESTED = ("5.24", "5.25")


class TransformersInternalError(KVStateError):
    """A transformers internal kvstate relies on moved or changed in the installed release."""


def version() -> str:
    return str(transformers.__version__)


def _minor(v: str) -> tuple[int, int]:
    parts = v.split(".")
    return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0)


def tested_range() -> str:
    return f"transformers {TESTED[0]}.x to {TESTED[1]}.x"


def in_tested_range(v: str | None = None) -> bool:
    m = _minor(v or version())
    return _minor(TESTED[0] + ".0") <= m <= _minor(TESTED[1] + ".0")


def warn_if_untested() -> None:
    """One warning line when the installed transformers is outside :data:`TESTED` (never an exception)."""
    if not in_tested_range():
        warnings.warn(f"kvstate was tested with {tested_range()}; transformers {version()} is installed — "
                      "run `make canary` to check this release", RuntimeWarning, stacklevel=2)


def _broken(internal: str, what: str) -> TransformersInternalError:
    return TransformersInternalError(f"transformers {version()}: {internal} {what} (kvstate is tested with "
                                     f"{tested_range()}; run `make canary`, see kvstate/models/compat.py)")


def internal(module: str, name: str) -> Any:
    """``module.name`` from transformers, or one error line naming the version and the internal."""
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        raise _broken(f"module {module}", f"does not import ({exc})") from exc
    if not hasattr(mod, name):
        raise _broken(f"{module}.{name}", "is gone")
    return getattr(mod, name)


# cache layers: the classes kvstate snapshots and fills, with the attributes it reads or calls
DynamicLayer = internal("transformers.cache_utils", "DynamicLayer")
DummyLayer = internal("transformers.cache_utils", "DummyLayer")
CacheLayerMixin = internal("transformers.cache_utils", "CacheLayerMixin")
LinearAttentionCacheLayerMixin = internal("transformers.cache_utils", "LinearAttentionCacheLayerMixin")
Cache = internal("transformers.cache_utils", "Cache")
# class name -> (methods it must define, state attributes a live layer must hold after a forward pass)
CACHE_LAYER_CONTRACT: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "DynamicLayer": (("update", "get_seq_length"), ("keys", "values", "is_initialized")),
    "LinearAttentionCacheLayerMixin": (("update_conv_state", "update_recurrent_state"),
                                       ("conv_states", "recurrent_states", "is_conv_states_initialized",
                                        "is_recurrent_states_initialized", "number_of_states")),
}

# attention: the registry SEKV / R-CLA install into, and the kernels they fall back to
ALL_ATTENTION_FUNCTIONS = internal("transformers.modeling_utils", "ALL_ATTENTION_FUNCTIONS")
sdpa_attention_forward = internal("transformers.integrations.sdpa_attention", "sdpa_attention_forward")
AttentionMaskInterface = internal("transformers.masking_utils", "AttentionMaskInterface")
sdpa_mask = internal("transformers.masking_utils", "sdpa_mask")
MODEL_FOR_CAUSAL_LM_MAPPING_NAMES = internal("transformers.models.auto.modeling_auto",
                                             "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES")


def base_streamer() -> type:
    return internal("transformers.generation.streamers", "BaseStreamer")  # type: ignore[no-any-return]


def hf_logging() -> ModuleType:
    return internal("transformers.utils", "logging")  # type: ignore[no-any-return]


def set_recurrent_length(layer: Any, length: int) -> None:
    """Record on a linear-attention cache layer that its restored state covers ``length`` tokens.

    transformers 5.25 counts a linear-attention layer's tokens (``cumulative_length_linear``, a tensor): a
    forward adds its tokens, but ``update_conv_state`` on an empty layer adds the conv window's width, so a state
    restored through the layer's own update methods would report 4 tokens, and ``generate`` (which now asks
    every cache for its length) would re-feed the prompt. 5.24 keeps no count (nothing to set)."""
    counter = getattr(layer, "cumulative_length_linear", None)
    if counter is None:
        return
    if isinstance(counter, torch.Tensor):
        counter.fill_(int(length))
    else:
        layer.cumulative_length_linear = int(length)


def attn_implementation(config: Any) -> str:
    """The attention implementation a config runs (``config._attn_implementation``)."""
    if not hasattr(config, "_attn_implementation"):
        raise _broken("PretrainedConfig._attn_implementation", "is gone")
    return str(config._attn_implementation)


# family modeling modules: rotary helpers and the eager kernel, read from the module that defines a layer
FAMILY_FUNCTIONS = ("apply_rotary_pos_emb", "rotate_half", "eager_attention_forward")


def family_module(obj: Any) -> ModuleType:
    """The transformers modeling module that defines ``obj``'s class (a model or one of its layers)."""
    return sys.modules[type(obj).__module__]


def family_function(obj: Any, name: str) -> Callable[..., Any]:
    """``name`` (one of :data:`FAMILY_FUNCTIONS`) from the modeling module of ``obj``'s class."""
    mod = family_module(obj)
    fn = getattr(mod, name, None)
    if fn is None:
        raise _broken(f"{mod.__name__}.{name}", "is gone")
    return fn  # type: ignore[no-any-return]


def modeling_module(model_type: str) -> ModuleType:
    """``transformers.models.<dir>.modeling_<dir>`` of a ``model_type``."""
    d = "qwen3_5" if model_type == "qwen3_5_text" else model_type
    name = f"transformers.models.{d}.modeling_{d}"
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise _broken(f"module {name}", f"does not import ({exc})") from exc


def _plain_function(obj: Any, param: str) -> Callable[..., Any] | None:
    """The Python function behind ``obj`` whose signature names ``param``, looking through the wrappers
    transformers puts on its kernels: ``functools.wraps`` chains, a kernels-hub ``Func`` module (its
    ``forward``) and closures (the function a wrapper calls)."""
    seen: set[int] = set()
    todo: list[Any] = [obj]
    while todo:
        cur = todo.pop(0)
        if id(cur) in seen or cur is None:
            continue
        seen.add(id(cur))
        if inspect.isfunction(cur) or inspect.ismethod(cur):
            try:
                params = inspect.signature(cur, follow_wrapped=False).parameters
            except (TypeError, ValueError):
                params = {}  # type: ignore[assignment]
            if param in params:
                return cur  # type: ignore[no-any-return]
            func = getattr(cur, "__func__", cur)
            todo.append(getattr(func, "__wrapped__", None))
            for cell in getattr(func, "__closure__", None) or ():
                try:
                    todo.append(cell.cell_contents)
                except ValueError:  # an empty cell
                    continue
        elif callable(cur):
            todo.append(getattr(cur, "__wrapped__", None))
            todo.append(getattr(cur, "forward", None))
    return None


def gated_deltanet_chunk_size(model_type: str) -> int:
    """The chunk length of the torch fallback ``torch_chunk_gated_delta_rule`` of a Gated-DeltaNet family
    (Qwen3.5 / Qwen3-Next; 64 in transformers 5.24 and 5.25) — the default the model's forward runs with."""
    mod = modeling_module(model_type)
    kernel = getattr(mod, "torch_chunk_gated_delta_rule", None)
    if kernel is None:
        raise _broken(f"{mod.__name__}.torch_chunk_gated_delta_rule", "is gone")
    fn = _plain_function(kernel, "chunk_size")
    if fn is None:
        raise _broken(f"{mod.__name__}.torch_chunk_gated_delta_rule", "has no chunk_size argument behind its wrappers")
    default = inspect.signature(fn, follow_wrapped=False).parameters["chunk_size"].default
    if not isinstance(default, int) or default <= 0:
        raise _broken(f"{mod.__name__}.torch_chunk_gated_delta_rule(chunk_size=)", f"defaults to {default!r}")
    return default


def check_cache(cache: Any) -> list[str]:
    """One line per cache layer of ``cache`` (after a forward pass) missing an attribute kvstate uses."""
    problems = []
    for i, layer in enumerate(cache.layers):
        for cls_name, (methods, state) in CACHE_LAYER_CONTRACT.items():
            if isinstance(layer, globals()[cls_name]):
                problems += [f"transformers {version()}: layer {i} ({type(layer).__name__}) has no {cls_name}.{a}"
                             for a in (*methods, *state) if not hasattr(layer, a)]
    return problems


def check_internals() -> list[str]:
    """One line per internal that no longer holds in the installed transformers (empty: all hold)."""
    problems: list[str] = []
    for cls_name, (methods, _state) in CACHE_LAYER_CONTRACT.items():
        cls = globals()[cls_name]
        problems += [f"transformers {version()}: {cls_name}.{a} is gone" for a in methods if not hasattr(cls, a)]
    for model_type in ("llama", "qwen3", "qwen3_5_text", "qwen3_next", "mamba2", "bamba", "falcon_h1"):
        try:
            mod = modeling_module(model_type)
        except TransformersInternalError as exc:
            problems.append(str(exc))
            continue
        if model_type in ("llama", "qwen3"):
            problems += [f"transformers {version()}: {mod.__name__}.{n} is gone" for n in FAMILY_FUNCTIONS
                         if not hasattr(mod, n)]
        if model_type in ("qwen3_5_text", "qwen3_next"):
            try:
                gated_deltanet_chunk_size(model_type)
            except TransformersInternalError as exc:
                problems.append(str(exc))
    for name in ("get_interface", "register"):
        if not hasattr(ALL_ATTENTION_FUNCTIONS, name) and not hasattr(type(ALL_ATTENTION_FUNCTIONS), name):
            problems.append(f"transformers {version()}: ALL_ATTENTION_FUNCTIONS.{name} is gone")
    return problems


__all__ = [
    "ALL_ATTENTION_FUNCTIONS", "CACHE_LAYER_CONTRACT", "FAMILY_FUNCTIONS", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "TESTED", "AttentionMaskInterface", "Cache", "CacheLayerMixin", "DummyLayer", "DynamicLayer",
    "LinearAttentionCacheLayerMixin", "TransformersInternalError", "attn_implementation", "base_streamer",
    "check_cache", "check_internals", "family_function", "family_module", "gated_deltanet_chunk_size",
    "hf_logging", "in_tested_range", "internal", "modeling_module", "sdpa_attention_forward", "sdpa_mask",
    "set_recurrent_length",
    "tested_range", "version", "warn_if_untested",
]
warn_if_untested()
