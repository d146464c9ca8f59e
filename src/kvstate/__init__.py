"""kvstate — manage the state an LLM carries between tokens.

Four techniques, one per axis (see ``docs/techniques.md``):

- position: :mod:`kvstate.prefix` — sparse prefix caching for hybrid / recurrent models ("Sparse Prefix Caching for Hybrid and Recurrent LLM Serving")
- depth: :mod:`kvstate.depth` — stochastic KV routing, R-CLA
- resolution: :mod:`kvstate.semantic` — SEKV ("SEKV: Resolution-Adaptive Semantic KV Cache with Hierarchical Semantic Memory")
- across models: :mod:`kvstate.transfer` — "Semantic Cache Distillation: Efficient State Transfer via Reuse and Selective Patching"

:mod:`kvstate.models` is the one place that knows transformers internals.
"""

from kvstate.errors import KVStateError, UnsupportedModelError

__version__ = "0.1.0"
__all__ = ["KVStateError", "UnsupportedModelError", "__version__"]
