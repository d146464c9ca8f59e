"""kvstate — manage the state an LLM carries between tokens.

Four techniques, one per axis (see ``shared/SPEC.md``):

- position: :mod:`kvstate.prefix` — sparse prefix caching for hybrid / recurrent models (seed 000)
- depth: :mod:`kvstate.depth` — stochastic KV routing, R-CLA (seed 001)
- resolution: :mod:`kvstate.semantic` — SEKV (seed 002)
- across models: :mod:`kvstate.transfer` — Semantic Cache Distillation (seed 004)

:mod:`kvstate.models` is the one place that knows transformers internals.
"""

from kvstate.errors import KVStateError, UnsupportedModelError

__version__ = "0.1.0"
__all__ = ["KVStateError", "UnsupportedModelError", "__version__"]
