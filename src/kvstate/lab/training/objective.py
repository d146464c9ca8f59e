"""The training objective of :mod:`kvstate.lab.training.train`: answer-weighted loss, answer statistics, lr schedule.

Split out of the training loop so that it stays one readable file; see that module for the recipe.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvstate.lab.training.config import TrainConfig


def answer_stats(logits: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                 answer_weight: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row: (has an answer, greedy exact match of the whole answer, first answer token correct)."""
    pred = logits[:, :-1].argmax(-1)  # (B, T-1): prediction of token t+1
    ans = weights[:, 1:] >= answer_weight  # (B, T-1)
    correct = (pred == ids[:, 1:]) | ~ans
    first = ans.float().argmax(-1)  # index of the first answer position per row
    first_ok = (pred == ids[:, 1:]).gather(1, first[:, None])[:, 0]
    return ans.any(-1), correct.all(-1), first_ok


def weighted_loss(ce: torch.Tensor, weights: torch.Tensor, cfg: TrainConfig) -> torch.Tensor:
    """Answer and prompt cross-entropy mixed at a fixed share, so answers are not drowned at long lengths.

    With ``answer_weight`` x10 alone, 8 answer tokens against 1,000 prose tokens are 7% of the loss at 1K
    and the retrieval signal vanishes as the curriculum lengthens; ``answer_share`` keeps it constant.
    """
    if cfg.answer_share is None:
        return (ce * weights).sum() / weights.sum()
    ans, prompt = (weights >= cfg.answer_weight).float(), ((weights > 0) & (weights < cfg.answer_weight)).float()
    a = (ce * ans).sum() / ans.sum().clamp(min=1.0)
    p = (ce * prompt).sum() / prompt.sum().clamp(min=1.0)
    return cfg.answer_share * a + (1 - cfg.answer_share) * p


def _lr(cfg: TrainConfig, step: int, elapsed: float) -> float:
    warm = min(1.0, (step + 1) / cfg.warmup_steps)
    budget = cfg.minutes * 60
    decay_start = budget * (1 - cfg.decay_fraction)
    decay = 1.0 if elapsed < decay_start else max(0.1, 1 - 0.9 * (elapsed - decay_start) / (budget - decay_start))
    return cfg.lr * warm * decay
