"""The training run's one configuration: every field type- and range-checked on construction.

Used by ``kvstate train`` (:mod:`kvstate.lab.training.train`) for the reference models; fields override from the
CLI with ``--set FIELD=VALUE``. The default task mix is the reference models' final recipe
(``models/README.md``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvstate.lab.training.io import TrainError
from kvstate.validate import check_float, check_int

ARCHS = ("attn", "hybrid")
GATE_TASKS = ("niah_single", "niah_multikey")
# Row share of each task in a batch (normalised): the mix of the reference models' final phases (the
# hybrid's without ``copy``). ``niah_drill`` rows ask for every needle of their document and ``copy`` rows
# repeat random lists (:mod:`kvstate.lab.workloads.drills`): with the gate tasks alone, the 4-layer models sat
# at chance on multi-key selection and garbled codes after three digits (measured here; see the cards).
TASK_MIX = {"niah_single": 1.5, "niah_multikey": 2.5, "niah_drill": 6.0, "copy": 3.0, "niah_multivalue": 0.25,
            "niah_multiquery": 0.25, "vt": 0.25, "qa": 0.5, "fwe": 0.1, "cwe": 0.1, "text": 0.25}
DRILL, COPY = "niah_drill", "copy"
_BIG = 2**31 - 1
# (field, kind, low, high, low open): every number of TrainConfig is type- and range-checked first
_NUMBERS = (("minutes", float, 0.0, 1e6, True), ("seed", int, 0, 2**32 - 1, False), ("hidden_size", int, 2, 65536, False),
            ("num_layers", int, 1, 1024, False), ("intermediate_size", int, 1, 2**20, False),
            ("num_heads", int, 1, 1024, False), ("num_kv_heads", int, 1, 1024, False),
            ("start_length", int, 16, 2**20, False), ("max_length", int, 16, 2**20, False),
            ("tokens_per_step", int, 1, 2**24, False), ("min_batch", int, 1, 4096, False),
            ("max_batch", int, 1, 4096, False), ("lr", float, 0.0, 1.0, True), ("warmup_steps", int, 1, _BIG, False),
            ("decay_fraction", float, 0.0, 1.0, False), ("weight_decay", float, 0.0, 10.0, False),
            ("answer_weight", float, 1.0, 1e6, True), ("answer_share", float, 0.0, 1.0, True),
            ("advance_at", float, 0.0, 1.0, True), ("window", int, 1, 10**6, False),
            ("stage_patience_min", float, 0.0, 1e6, False), ("patience_floor", float, 0.0, 1.0, False),
            ("shorter_share", float, 0.0, 1.0, False), ("threads", int, 1, 1024, False),
            ("max_steps", int, 1, _BIG, False), ("save_every_min", float, 0.0, 1e6, True),
            ("log_every", int, 1, _BIG, False), ("resume_length", int, 16, 2**20, False))


@dataclass(frozen=True)
class TrainConfig:
    """One training run; sizes default to the reference models (``models/README.md``)."""

    arch: str = "attn"  # "attn" (Qwen3) or "hybrid" (Qwen3.5 text: 3 Gated DeltaNet : 1 attention)
    minutes: float = 30.0  # wall-clock budget of this run (a resumed run adds to the total)
    seed: int = 0  # model init and data stream
    hidden_size: int = 256
    num_layers: int | None = None  # None: 4 (attn) / 8 (hybrid)
    intermediate_size: int = 768
    num_heads: int = 4
    num_kv_heads: int = 2
    start_length: int = 64  # first curriculum stage (tokens per row)
    max_length: int = 4096  # last stage; training stays here once reached
    tokens_per_step: int = 4096  # batch = tokens_per_step // length, clamped to [min_batch, max_batch]
    min_batch: int = 2
    max_batch: int = 32
    lr: float = 1e-3
    warmup_steps: int = 30
    # True: every part (resume) warms up again (the reference models were trained so); False: warm-up counts
    # from the run's first step and a resumed part continues the schedule (depth runs)
    warmup_per_part: bool = True
    decay_fraction: float = 0.15  # last fraction of `minutes` decays lr linearly to 10%
    weight_decay: float = 0.01
    answer_weight: float = 10.0  # marks answer tokens in training_batch's weights (and weighs them when answer_share=None)
    answer_share: float | None = 0.8  # loss = share * mean answer CE + (1 - share) * mean prompt CE
    advance_at: float = 0.75  # gate-task accuracy (advance_metric) that doubles the length
    advance_metric: str = "first_token"  # "first_token" (first answer token right) or "exact" (whole answer)
    window: int = 96  # rows per gate task averaged for the curriculum decision
    stage_patience_min: float = 3.0  # after this long in a stage, advance once the mean gate metric passes
    patience_floor: float = 0.0  # ... this floor: a plateau at a short length must not stall the curriculum
    shorter_share: float = 0.25  # steps drawn at a random earlier stage's length (keeps short contexts solved)
    bf16: bool = True
    threads: int = 2
    max_steps: int | None = None  # stop early (tests)
    save_every_min: float = 5.0
    log_every: int = 20  # steps between learning-curve points
    task_mix: dict[str, float] | None = None  # row shares per task; None: TASK_MIX
    resume_length: int | None = None  # a resumed run restarts the curriculum at this length (None: where it was)

    @property
    def mix(self) -> dict[str, float]:
        return dict(TASK_MIX if self.task_mix is None else self.task_mix)

    def __post_init__(self) -> None:
        if not isinstance(self.arch, str) or self.arch not in ARCHS:
            raise TrainError(f"TrainConfig.arch={self.arch!r} is not one of {', '.join(ARCHS)}")
        for name, kind, lo, hi, lo_open in _NUMBERS:
            value = getattr(self, name)
            if value is None and name in ("num_layers", "answer_share", "max_steps", "resume_length"):
                continue
            if kind is int:
                check_int(f"TrainConfig.{name}", value, lo, hi, error=TrainError)
            else:
                check_float(f"TrainConfig.{name}", value, lo, hi, lo_open=lo_open, hi_open=name in (
                    "answer_share", "decay_fraction", "shorter_share"), error=TrainError)
        if not isinstance(self.bf16, bool) or not isinstance(self.advance_metric, str):
            raise TrainError(f"TrainConfig: bf16={self.bf16!r} must be true/false and advance_metric a string")
        if not isinstance(self.warmup_per_part, bool):
            raise TrainError(f"TrainConfig.warmup_per_part={self.warmup_per_part!r} must be true or false")
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 2 or self.num_heads % self.num_kv_heads:
            raise TrainError(f"TrainConfig: hidden_size={self.hidden_size} must divide by num_heads={self.num_heads} "
                             f"into an even head size, and num_heads by num_kv_heads={self.num_kv_heads}")
        if self.num_layers is not None and (self.num_layers < 1 or (self.arch == "hybrid" and self.num_layers % 4)):
            raise TrainError(f"TrainConfig.num_layers={self.num_layers} must be >= 1 (a multiple of 4 for hybrid: "
                             "3 Gated DeltaNet : 1 attention)")
        if not 16 <= self.start_length <= self.max_length:
            raise TrainError(f"TrainConfig: need 16 <= start_length ({self.start_length}) <= max_length "
                             f"({self.max_length})")
        if not 1 <= self.min_batch <= self.max_batch:
            raise TrainError(f"TrainConfig: need 1 <= min_batch ({self.min_batch}) <= max_batch ({self.max_batch})")
        if not self.answer_weight > 1.0:
            raise TrainError(f"TrainConfig.answer_weight={self.answer_weight} must be > 1 (answer tokens are "
                             "found by their weight)")
        if self.answer_share is not None and not 0.0 < self.answer_share < 1.0:
            raise TrainError(f"TrainConfig.answer_share={self.answer_share} must be in (0, 1) or None")
        if not 0.0 <= self.shorter_share < 1.0:
            raise TrainError(f"TrainConfig.shorter_share={self.shorter_share} must be in [0, 1)")
        if not 0.0 < self.advance_at <= 1.0 or not 0.0 <= self.decay_fraction < 1.0:
            raise TrainError(f"TrainConfig: advance_at={self.advance_at} must be in (0, 1] and "
                             f"decay_fraction={self.decay_fraction} in [0, 1)")
        if self.advance_metric not in ("first_token", "exact"):
            raise TrainError(f"TrainConfig.advance_metric={self.advance_metric!r} must be 'first_token' or 'exact'")
        if self.task_mix is not None:
            if not isinstance(self.task_mix, dict) or not all(
                    isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                    for v in self.task_mix.values()):
                raise TrainError(f"TrainConfig.task_mix={self.task_mix!r} must be a JSON object of task -> finite share")
            unknown = sorted(set(self.task_mix) - set(TASK_MIX))
            if unknown or not all(v >= 0 for v in self.task_mix.values()) or not any(
                    self.task_mix.get(t, 0) > 0 for t in GATE_TASKS):
                raise TrainError(f"TrainConfig.task_mix={self.task_mix} must map tasks of {', '.join(TASK_MIX)} "
                                 f"(unknown: {unknown or 'none'}) to shares >= 0, with a gate task "
                                 f"({', '.join(GATE_TASKS)}) above 0")
        if self.resume_length is not None and not self.start_length <= self.resume_length <= self.max_length:
            raise TrainError(f"TrainConfig.resume_length={self.resume_length} must lie in [start_length, max_length] "
                             f"= [{self.start_length}, {self.max_length}]")

    @property
    def layers(self) -> int:
        return self.num_layers or (4 if self.arch == "attn" else 8)

    def batch_for(self, length: int) -> int:
        return max(self.min_batch, min(self.max_batch, self.tokens_per_step // length))
