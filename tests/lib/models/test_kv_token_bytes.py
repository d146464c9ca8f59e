"""One per-token KV formula: kv_token_bytes, checked against the bytes a real cache holds."""

import torch

from kvstate.models import cache_nbytes, kv_bytes_per_token, kv_token_bytes, tiny_model


def test_the_formula_matches_a_filled_cache_and_the_config_accounting():
    model = tiny_model("qwen3")
    cfg = model.config
    t = 7
    out = model(input_ids=torch.arange(t)[None], use_cache=True)
    per_token = cache_nbytes(out.past_key_values) / t
    assert kv_bytes_per_token(cfg) == per_token
    assert kv_token_bytes(cfg.num_key_value_heads, cfg.head_dim, 4, cfg.num_hidden_layers) == per_token
    assert kv_token_bytes(2, 16, 2) == 2 * 2 * 16 * 2
