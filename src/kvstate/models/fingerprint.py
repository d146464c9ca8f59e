"""A model's identity: one SHA-256 over the architecture fields of its config and the bytes of every weight.

What the learned add-ons record and check before they run on a model: a SEKV router
(:mod:`kvstate.semantic.router`) and an SCD codec (:mod:`kvstate.transfer.codec`) are fitted to one
model's weights and refuse to load onto another. Hashed, in this order: the decoder text config's
fields in :data:`CONFIG_FIELDS` (those that change what a forward pass computes or the shape of its
state; a missing field hashes as null) as sorted-key JSON, then for every ``state_dict`` entry in name
order its name, shape, dtype and raw bytes. So the same weights loaded in another dtype are another
model (a state computed in bf16 is not the fp32 model's). Reading every byte costs about as much as
one copy of the weights (a few milliseconds for a 3.5M-parameter model). Ignored: the tokenizer and
generation settings (they do not change the KV or recurrent state for given token ids).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

from kvstate.models.families import text_config

CONFIG_FIELDS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "tie_word_embeddings",
                 "layer_types", "rope_parameters")


def model_fingerprint(model: Any) -> str:
    """SHA-256 (64 hex digits) of ``model``'s architecture config fields and every weight's name, shape, dtype, bytes."""
    tc = text_config(model.config)
    fields = {k: getattr(tc, k, None) for k in CONFIG_FIELDS}
    h = hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode())
    for name, t in sorted(model.state_dict().items()):
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
