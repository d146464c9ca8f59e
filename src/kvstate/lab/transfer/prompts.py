"""Calibration prefixes for an SCD codec, drawn from the synthetic workloads' calibration seed stream.

*Semantic Cache Distillation: Efficient State Transfer via Reuse and Selective Patching* calibrates once per
model pair on a small set of paired prefixes; :func:`kvstate.transfer.calibrate_on` takes any prefixes, and
this module supplies the lab's (``docs/techniques.md#across-models``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvstate.lab.workloads.tasks import generate
from kvstate.transfer.calibrate import CalibrationConfig


def calibration_prompts(tokenizer: Any, cfg: CalibrationConfig) -> list[torch.Tensor]:
    """``cfg.prefixes`` token-id tensors (1, T) of the synthetic tasks, from the calibration seed stream; each
    prompt ends with its answer, so the tokens calibration scores (its last ``suffix``) include what retrieval
    produces, not only the question."""
    per = -(-cfg.prefixes // len(cfg.tasks))
    out = []
    for task in cfg.tasks:
        for ex in generate(task, cfg.length, per, cfg.seed, tokenizer):
            text = f"{ex.prompt} {ex.target}" if ex.target else ex.prompt
            out.append(torch.tensor([tokenizer(text)["input_ids"]], dtype=torch.long))
    order = np.random.default_rng(cfg.seed).permutation(len(out))[: cfg.prefixes]
    return [out[i] for i in order]
