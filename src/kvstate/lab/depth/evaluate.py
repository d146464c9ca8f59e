"""Quality against KV memory under cross-layer sharing: the measurement behind ``kvstate depth eval``.

For each kept fraction a pattern of the chosen family (:func:`kvstate.depth.patterns.for_keep`) is
applied (:func:`kvstate.depth.sharing.apply_sharing`) and the model is scored under the lab's protocol
(``docs/lab.md``): ``score`` = mean exact match over the needle tasks the full cache solves
(``niah_single``, ``niah_multikey`` at 1K and 2K tokens; greedy decoding through the sharing cache),
with a 95% interval; ``ppl`` = perplexity on ``ppl_texts`` held-out texts (full forward under the same
pattern) with a bootstrap interval over texts; ``kv_bytes_per_token`` = bytes of the cache tensors after
prefill divided by the prompt tokens and ``peak_bytes`` = the largest cache held on any item (measured
from tensors, not computed); ``decode_tok_s`` = greedy decoding tokens per second. Per-item scores are
kept (``items``), and per-text NLL sums with their token counts (``text_nll``), so two models or two keeps
can be compared *paired* on the same items and texts. Used for Random
Cross-Layer Attention ("Stochastic KV Routing") and its controls.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvstate.lab import protocol, stats

SCORE_TASKS = ("niah_single", "niah_multikey")  # the tasks the full cache solves at these lengths
SCORE_LENGTHS = (1024, 2048)
PPL_LENGTH = 1024


def evaluate_sharing(model_dir: str | Path, keeps: Sequence[float], kind: str = "keep", *, n: int = 10, seed: int = 0,
                     progress: bool = False, model: Any = None, tokenizer: Any = None,
                     tasks: Sequence[str] = SCORE_TASKS, lengths: Sequence[int] = SCORE_LENGTHS,
                     ppl_length: int = PPL_LENGTH, ppl_texts: int = protocol.PPL_TEXTS) -> dict[str, Any]:
    """``{"model", "n", "seed", "tasks", "lengths", "ppl_texts", "results": [row per keep]}``.

    A row: ``keep, pattern, ppl, ppl_ci, score, score_ci, kv_bytes_per_token, peak_bytes, decode_tok_s,
    items`` (per-item exact match, in ``(task, length, index)`` order). Every pattern is built (and every
    bad fraction rejected) before the model runs. ``model`` / ``tokenizer`` skip loading ``model_dir``.
    """
    from kvstate.depth.attention import layer_specs
    from kvstate.depth.patterns import for_keep, format_pattern
    from kvstate.depth.sharing import apply_sharing, sharing_cache
    from kvstate.lab.harness import load_reference, run_tasks
    from kvstate.lab.perplexity import continuation_nll
    from kvstate.lab.workloads.tasks import generate

    if model is None:
        model, tokenizer = load_reference(model_dir)
    specs = layer_specs(model.config)
    patterns = [(k, for_keep(specs, kind, k)) for k in keeps]
    texts = [tokenizer(ex.prompt)["input_ids"] for ex in generate("text", ppl_length, ppl_texts, seed, tokenizer)]
    rows = []
    for keep, pattern in patterns:
        with apply_sharing(model, pattern):
            res = run_tasks(model, tokenizer, list(tasks), list(lengths), n, seed,
                            cache_factory=lambda m, pat=pattern: sharing_cache(m.config, pat), progress=progress)
            nll = [continuation_nll(model, ids) for ids in texts]
        items = [float(e.score) for e in res.examples]
        score = stats.rate(items, seed=seed)
        ppl = stats.perplexity([t.nll for t in nll], [t.tokens for t in nll], seed=seed)
        per_token = [e.cache_bytes / e.n_tokens for e in res.examples]
        decode_s = sum(e.decode_s for e in res.examples)
        rows.append({"keep": keep, "pattern": format_pattern(pattern),
                     "ppl": round(ppl.value, 4), "ppl_ci": [round(ppl.lo, 4), round(ppl.hi, 4)],
                     "score": round(score.value, 4), "score_ci": [round(score.lo, 4), round(score.hi, 4)],
                     "kv_bytes_per_token": round(sum(per_token) / len(per_token), 2),
                     "peak_bytes": max(e.cache_bytes for e in res.examples),
                     "decode_tok_s": round(sum(e.new_tokens for e in res.examples) / decode_s, 1) if decode_s else 0.0,
                     "items": items, "text_nll": [[round(t.nll, 5), t.tokens] for t in nll]})
    return {"model": str(model_dir), "n": n, "seed": seed, "tasks": list(tasks), "lengths": list(lengths),
            "ppl_texts": ppl_texts, "ppl_length": ppl_length, "results": rows}


__all__ = ["SCORE_LENGTHS", "SCORE_TASKS", "evaluate_sharing"]
