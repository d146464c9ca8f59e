"""Self-distillation for stochastic KV routing: the routed model learns from its own full-KV pass.

In the same training step the model runs twice on the batch: once under the step's route (the student,
with gradients) and once with every layer on its own K/V under ``torch.no_grad`` (the teacher: a
stop-gradient copy of the same weights, so no second model is held). The added loss is the KL divergence
from the teacher's next-token distribution to the student's. It asks a routed pass to reproduce what the
full cache predicts — including *which* needle it retrieves — instead of only the next token, the signal
SwiftKV ("SwiftKV: Fast Prefill-Optimized Inference with Knowledge-Preserving Model Transformation") and
X-EcoMLA use to keep quality while shrinking the KV cache. Ignored: distillation of attention maps.
"""

from __future__ import annotations

from typing import Any

import torch

from kvstate.depth.routing import StochasticKVRouting


def distillation_loss(student: torch.Tensor, teacher: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over positions of KL(softmax(teacher) || softmax(student)) on (B, T, V) logits, in fp32.

    ``weights`` (B, T): per-position weights (0 drops a position, e.g. padding; the training weights make an
    answer token count as much in the KL as in the cross-entropy); ``None``: a plain mean. The teacher gets no
    gradient. Zero exactly when the two distributions are equal."""
    log_s = torch.log_softmax(student.float(), -1)  # (B, T, V)
    log_t = torch.log_softmax(teacher.detach().float(), -1)  # (B, T, V)
    kl = (log_t.exp() * (log_t - log_s)).sum(-1)  # (B, T)
    if weights is None:
        return kl.mean()
    w = weights.to(kl.dtype)
    return (kl * w).sum() / w.sum().clamp(min=1e-12)


def own_kv_logits(model: Any, routing: StochasticKVRouting, input_ids: torch.Tensor) -> torch.Tensor:
    """The teacher: ``model``'s logits (B, T, V) with every layer on its own K/V, no gradient, no draw consumed."""
    with torch.no_grad(), routing.own_kv_pass():
        return model(input_ids=input_ids, use_cache=False).logits


__all__ = ["distillation_loss", "own_kv_logits"]
