"""The equal-KV dense baseline for R-CLA: a reference model with fewer KV heads, initialised by mean-pooling.

"Stochastic KV Routing" compares a model that drops half its layer caches with a self-attention model
of the same KV size. For the 4-layer reference model (2 KV heads of 64) that is a model with one KV
head per layer. It starts from the reference weights as in GQA uptraining ("GQA: Training Generalized
Multi-Query Transformer Models from Multi-Head Checkpoints"): each group of adjacent KV heads becomes
one head whose ``k_proj`` / ``v_proj`` rows (and biases) are the mean of the group's. Qwen3's
``k_norm`` / ``q_norm`` weigh the head dimension and are shared by all heads (shape ``(head_dim,)``),
so they are kept as they are; a layout with per-head norms is refused. The query heads of a group then
all read the merged head, exactly as they read their own group's head before.

:func:`init_kv1` writes a directory that ``kvstate depth train --model DIR`` continues (weights,
tokenizer, ``training_state.json`` with ``num_kv_heads`` updated, checksum manifest). It holds no
optimizer state: the source's moments do not fit the merged projections, and the committed
reference model holds none either, so every depth run from it starts a fresh AdamW too.
Ignored: Qwen3.5 gated attention (refused by :func:`kvstate.depth.attention.attention_modules`).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch

from kvstate.errors import KVStateError

KV1_KEY = "kv1"  # training-state entry: where the merged model came from


def _merge_rows(weight: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    """Rows of ``heads`` blocks (weight ``(heads * D, ...)`` or bias ``(heads * D,)``) -> ``kv_heads`` block means."""
    per_head = weight.shape[0] // heads
    blocks = weight.reshape(kv_heads, heads // kv_heads, per_head, *weight.shape[1:])  # (G, heads/G, D, ...)
    return blocks.mean(1).reshape(kv_heads * per_head, *weight.shape[1:])


def merge_kv_heads(model: Any, kv_heads: int = 1) -> Any:
    """A new model like ``model`` with ``kv_heads`` KV heads per layer, each the mean of adjacent heads."""
    import transformers as tf

    from kvstate.depth.attention import attention_modules
    from kvstate.models.families import text_config

    modules = attention_modules(model)  # raises for layouts the routed attention does not know
    tc = text_config(model.config)
    heads = int(tc.num_key_value_heads)
    if isinstance(kv_heads, bool) or not isinstance(kv_heads, int) or kv_heads < 1 or heads % kv_heads:
        raise KVStateError(f"kv_heads={kv_heads!r} must be an int >= 1 that divides the model's {heads} KV heads")
    config = copy.deepcopy(model.config)
    text_config(config).num_key_value_heads = kv_heads
    prefix: dict[int, str] = {}
    names = {id(m): n for n, m in model.named_modules()}
    for i, attn in modules.items():
        prefix[i] = names[id(attn)]
        norm = getattr(attn, "k_norm", None)
        if norm is not None and tuple(norm.weight.shape) != (attn.head_dim,):
            raise KVStateError(f"layer {i}: k_norm has shape {tuple(norm.weight.shape)}, not ({attn.head_dim},) "
                               "shared by all heads; merging per-head norms is not supported")
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for name in prefix.values():
        for proj in ("k_proj", "v_proj"):
            for part in ("weight", "bias"):
                key = f"{name}.{proj}.{part}"
                if key in state:
                    state[key] = _merge_rows(state[key], heads, kv_heads)
    with torch.random.fork_rng(devices=[]):
        merged = tf.AutoModelForCausalLM.from_config(config)
    merged = merged.to(next(model.parameters()).dtype)
    merged.load_state_dict(state, strict=True)
    return merged.train(model.training)


def init_kv1(model_dir: str | Path, out_dir: str | Path, *, kv_heads: int = 1, overwrite: bool = False) -> dict[str, Any]:
    """Write ``model_dir`` merged to ``kv_heads`` KV heads into ``out_dir``, ready for ``kvstate depth train``;
    returns the written training state."""
    from kvstate.integrity import accepts_kind, write_manifest
    from kvstate.io_safety import check_not_input, check_output_dir, staged_dir
    from kvstate.lab.depth.train import DEPTH_KEY
    from kvstate.lab.harness import load_reference
    from kvstate.lab.training.io import STATE_FILE, load_state
    from kvstate.lab.training.train import CONTEXT_KEY

    out = Path(out_dir)
    check_not_input(out, {"--model": model_dir})
    check_output_dir(out, overwrite=overwrite, accept=accepts_kind("model"), kind="a model directory")
    state = load_state(model_dir)  # refuses a directory that is not a training output
    model, tokenizer = load_reference(model_dir, torch.float32)
    before = int(model.config.num_key_value_heads)
    merged = merge_kv_heads(model, kv_heads)
    state = {k: v for k, v in state.items() if k not in (CONTEXT_KEY, DEPTH_KEY)}  # a new model, a new run
    state["config"] = {**state["config"], "num_kv_heads": kv_heads}
    state["params"] = sum(p.numel() for p in merged.parameters())
    state[KV1_KEY] = {"from": str(model_dir), "step": int(state["step"]), "kv_heads": [before, kv_heads],
                      "init": "mean of each group of adjacent KV heads' k_proj / v_proj (GQA uptraining)"}
    merged.config.dtype = "float32"
    with staged_dir(out) as tmp:
        merged.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=1))
        write_manifest(tmp)
    return state


__all__ = ["KV1_KEY", "init_kv1", "merge_kv_heads"]
