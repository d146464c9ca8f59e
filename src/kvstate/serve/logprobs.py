"""Logprobs in OpenAI's two response shapes (completions' parallel lists, chat's per-token objects).

The values are the model's raw log-probabilities (vLLM's default), recorded per reply token by the sampler
(:class:`~kvstate.serve.generation.TokenLogprob`); this module only renders them. Ignores: the prompt's
logprobs (``echo``) and logprobs while streaming.
"""

from __future__ import annotations

from typing import Any

from kvstate.serve.generation import Generation


def _piece(tokenizer: Any, token: int) -> str:
    return str(tokenizer.decode([token], skip_special_tokens=False))


def completion(tokenizer: Any, g: Generation) -> dict[str, Any]:
    """``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`` of /v1/completions."""
    tokens, offsets, at = [], [], 0
    for t in g.logprobs:
        piece = _piece(tokenizer, t.token)
        tokens.append(piece)
        offsets.append(at)
        at += len(piece)
    return {"tokens": tokens, "token_logprobs": [t.logprob for t in g.logprobs],
            "top_logprobs": [{_piece(tokenizer, i): lp for i, lp in t.top} for t in g.logprobs],
            "text_offset": offsets}


def chat(tokenizer: Any, g: Generation) -> dict[str, Any]:
    """``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`` of /v1/chat/completions."""
    def entry(token: int, logprob: float) -> dict[str, Any]:
        piece = _piece(tokenizer, token)
        return {"token": piece, "logprob": logprob, "bytes": list(piece.encode("utf-8", "replace"))}

    return {"content": [{**entry(t.token, t.logprob), "top_logprobs": [entry(i, lp) for i, lp in t.top]}
                        for t in g.logprobs]}
