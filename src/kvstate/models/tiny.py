"""Tiny random-weight configs of every supported family, built from the real transformers config classes.

Tests and the report use these (no hub download is possible). ``qwen35_08b_config`` is a config with
the public dimensions of Qwen3.5-0.8B (24 layers, 3 Gated DeltaNet : 1 full attention) for byte
accounting without weights.
"""

from __future__ import annotations

from typing import Any

import torch
import transformers as tf

_ATTN = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2}
_GDN = {"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16}
_MAMBA = {"mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_state": 16, "mamba_n_groups": 1}


def _qwen3_5(**kw: Any) -> Any:
    return tf.Qwen3_5TextConfig(**{**_ATTN, **_GDN, "head_dim": 16, "num_hidden_layers": 4, **kw})


def _qwen3_next(**kw: Any) -> Any:
    moe = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32}
    return tf.Qwen3NextConfig(**{**_ATTN, **_GDN, **moe, "head_dim": 16, "num_hidden_layers": 4, **kw})


TINY_CONFIGS: dict[str, Any] = {
    "llama": lambda **kw: tf.LlamaConfig(**{**_ATTN, "num_hidden_layers": 2, **kw}),
    "qwen3": lambda **kw: tf.Qwen3Config(**{**_ATTN, "head_dim": 16, "num_hidden_layers": 2, **kw}),
    "qwen3_5": _qwen3_5,
    "qwen3_next": _qwen3_next,
    "mamba2": lambda **kw: tf.Mamba2Config(
        **{"hidden_size": 64, "num_hidden_layers": 2, "num_heads": 8, "head_dim": 16, "state_size": 16, "n_groups": 1, **kw}
    ),
    "bamba": lambda **kw: tf.BambaConfig(**{**_ATTN, **_MAMBA, "num_hidden_layers": 4, "attn_layer_indices": [1, 3], **kw}),
    # ssm_out_multiplier 8: at random init Falcon-H1's SSM branch is otherwise too small for tests to see
    "falcon_h1": lambda **kw: tf.FalconH1Config(
        **{**_ATTN, **_MAMBA, "head_dim": 16, "num_hidden_layers": 2, "mamba_d_ssm": 128, "ssm_out_multiplier": 8.0, **kw}
    ),
}


def tiny_config(family: str, vocab_size: int = 128, **overrides: Any) -> Any:
    if family not in TINY_CONFIGS:
        raise ValueError(f"unknown tiny family {family!r}; choose one of {sorted(TINY_CONFIGS)}.")
    return TINY_CONFIGS[family](vocab_size=vocab_size, **overrides)


def tiny_model(family: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: Any) -> Any:
    """A random-weight causal LM of ``family`` in eval mode, deterministic by ``seed``."""
    config = tiny_config(family, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = tf.AutoModelForCausalLM.from_config(config)
    return model.to(dtype).eval()


def qwen35_08b_config() -> Any:
    """Qwen3.5-0.8B's public text dimensions (bf16), random weights if instantiated."""
    return tf.Qwen3_5TextConfig(
        vocab_size=248320,
        hidden_size=1024,
        intermediate_size=3584,
        num_hidden_layers=24,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        full_attention_interval=4,
        dtype="bfloat16",
    )
