"""kvstate.models — the one place that knows transformers internals.

Layer kinds, state snapshot/restore over the unified ``DynamicCache``, segmented prefill with explicit
``position_ids``, byte accounting, a model's fingerprint, local loading, and tiny random configs of every
supported family.
"""

from kvstate.models.accounting import (
    StateInfo,
    cache_nbytes,
    checkpoint_bytes,
    describe,
    kv_bytes_per_token,
    kv_token_bytes,
    recurrent_shape,
)
from kvstate.models.families import (
    FAMILIES,
    LayerKind,
    chunk_size,
    family_of,
    layer_kinds,
    supported_families,
)
from kvstate.models.fingerprint import model_fingerprint
from kvstate.models.loading import load_config, load_model
from kvstate.models.prefill import PrefillOutput, segmented_prefill
from kvstate.models.resumable import ResumableCache
from kvstate.models.state import (
    AttentionState,
    CacheSnapshot,
    LayerSnapshot,
    RecurrentState,
    restore_cache,
    snapshot_cache,
)
from kvstate.models.tiny import qwen35_08b_config, tiny_config, tiny_model

__all__ = [
    "FAMILIES",
    "AttentionState",
    "CacheSnapshot",
    "LayerKind",
    "LayerSnapshot",
    "PrefillOutput",
    "RecurrentState",
    "ResumableCache",
    "StateInfo",
    "cache_nbytes",
    "checkpoint_bytes",
    "chunk_size",
    "describe",
    "family_of",
    "kv_bytes_per_token",
    "kv_token_bytes",
    "layer_kinds",
    "load_config",
    "load_model",
    "model_fingerprint",
    "qwen35_08b_config",
    "recurrent_shape",
    "restore_cache",
    "segmented_prefill",
    "snapshot_cache",
    "supported_families",
    "tiny_config",
    "tiny_model",
]
