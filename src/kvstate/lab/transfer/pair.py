"""Where the real cross-model pair lives (Semantic Cache Distillation's producer and consumer on the real model).

Paths only, in a module of their own so the runs that read the pair (:mod:`kvstate.lab.transfer.realpair_eval`,
:mod:`kvstate.lab.transfer.realpair_bench`) do not execute the fine-tune's code (:mod:`kvstate.lab.transfer.realpair`)
and stay current when it changes.
"""

from __future__ import annotations

from pathlib import Path

BASE = Path("models/smollm2-135m-instruct")  # the producer (converted by make setup)
DELTA = Path("models/smollm2-135m-ft-delta")  # the committed LoRA factors
CONSUMER = Path("models/smollm2-135m-ft")  # the consumer, built from BASE + DELTA by make setup
CODEC = Path("models/codec-smollm2-135m-ft")  # the pair's SCD codec (realpair calibrate)

__all__ = ["BASE", "CODEC", "CONSUMER", "DELTA"]
