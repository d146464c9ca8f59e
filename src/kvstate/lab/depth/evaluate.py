"""Quality against KV memory under cross-layer sharing: the measurement behind ``kvstate depth eval``.

For each kept fraction a pattern of the chosen family (:func:`kvstate.depth.patterns.for_keep`) is
applied (:func:`kvstate.depth.sharing.apply_sharing`) and the model is scored with the evaluation
harness: ``score`` = mean exact match over the four needle tasks at 1K and 2K tokens (greedy decoding
through the sharing cache), ``ppl`` = perplexity on held-out ``text`` (full forward under the same
pattern), ``kv_bytes_per_token`` = bytes of the cache tensors after prefill divided by the prompt
tokens (measured, not computed), ``decode_tok_s`` = greedy decoding tokens per second. Used for
Random Cross-Layer Attention ("Stochastic KV Routing") and its controls.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

SCORE_TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery")
SCORE_LENGTHS = (1024, 2048)
PPL_LENGTH = 1024


def evaluate_sharing(model_dir: str | Path, keeps: Sequence[float], kind: str = "keep", *, n: int = 10, seed: int = 0,
                     progress: bool = False, model: Any = None, tokenizer: Any = None,
                     tasks: Sequence[str] = SCORE_TASKS, lengths: Sequence[int] = SCORE_LENGTHS,
                     ppl_length: int = PPL_LENGTH) -> dict[str, Any]:
    """``{"model": ..., "results": [{"keep", "pattern", "ppl", "score", "kv_bytes_per_token", "decode_tok_s"}]}``.

    Every pattern is built (and every bad fraction rejected) before the model runs. ``model`` /
    ``tokenizer`` skip loading ``model_dir`` (tests pass tiny models).
    """
    from kvstate.depth.attention import layer_specs
    from kvstate.depth.patterns import for_keep, format_pattern
    from kvstate.depth.sharing import apply_sharing, sharing_cache
    from kvstate.lab.harness import load_reference, perplexity, run_tasks

    if model is None:
        model, tokenizer = load_reference(model_dir)
    specs = layer_specs(model.config)
    patterns = [(k, for_keep(specs, kind, k)) for k in keeps]
    rows = []
    for keep, pattern in patterns:
        with apply_sharing(model, pattern):
            res = run_tasks(model, tokenizer, list(tasks), list(lengths), n, seed,
                            cache_factory=lambda m, pat=pattern: sharing_cache(m.config, pat), progress=progress)
            ppl = perplexity(model, tokenizer, ppl_length, n, seed)
        scores = res.scores()
        per_token = [e.cache_bytes / e.n_tokens for e in res.examples]
        decode_s = sum(e.decode_s for e in res.examples)
        rows.append({"keep": keep, "pattern": format_pattern(pattern), "ppl": round(ppl, 4),
                     "score": round(sum(s.score for s in scores) / len(scores), 4),
                     "kv_bytes_per_token": round(sum(per_token) / len(per_token), 2),
                     "decode_tok_s": round(sum(e.new_tokens for e in res.examples) / decode_s, 1) if decode_s else 0.0})
    return {"model": str(model_dir), "results": rows}


__all__ = ["SCORE_LENGTHS", "SCORE_TASKS", "evaluate_sharing"]
