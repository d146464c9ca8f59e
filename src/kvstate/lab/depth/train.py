"""Continue training a reference model with Random Cross-Layer Attention ("Stochastic KV Routing").

The loop is :func:`kvstate.lab.training.train.train` (curriculum tools, answer-weighted loss, resumable saves,
DDP under ``torchrun``); this module only wraps it in a routing context: stochastic routing with
probability ``p`` (R-CLA; ``p = 1`` is the no-routing control), or one fixed pattern at every step
(a specialist, e.g. CLA2 ``0_0_2_2``, always sharing as at deployment). Each DDP rank draws its own
routes (seed + rank). A run starts from a ``kvstate train`` output directory (a reference model) at a
fixed length and a constant learning rate, so runs with the same ``tokens`` see the same batches;
``training_state.json`` gains a ``depth`` entry (start model, routing, draw counts).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstate.depth.patterns import PatternError, SharingPattern, format_pattern
from kvstate.errors import KVStateError

DEPTH_KEY = "depth"
# what a depth run changes in the start model's TrainConfig: one length, constant lr, no curriculum moves
FINE_TUNE = {"lr": 3e-4, "decay_fraction": 0.0, "warmup_steps": 20, "stage_patience_min": 1e6, "threads": 1,
             "save_every_min": 3.0}


@dataclass(frozen=True)
class DepthTrainConfig:
    p: float = 0.5  # probability of a layer's own K/V per pass (1: no routing); ignored with a pattern
    pattern: str | None = None  # a fixed sharing pattern at every step, e.g. "0_0_2_2" (CLA2)
    length: int = 1024  # tokens per row (the curriculum stays here; shorter_share replays shorter ones)
    minutes: float | None = None  # wall-clock budget
    tokens: int | None = None  # token budget: tokens // tokens_per_step steps (same batches for every run)
    seed: int = 0  # routing seed (rank r draws with seed + r)

    def __post_init__(self) -> None:
        if not isinstance(self.p, (int, float)) or not 0.0 <= self.p <= 1.0:
            raise PatternError(f"--p {self.p!r} must lie in [0, 1] (1: every layer keeps its own K/V)")
        if self.minutes is None and self.tokens is None:
            raise KVStateError("depth train: pass --minutes M or --tokens N (the training budget)")
        if self.minutes is not None and not self.minutes > 0:
            raise KVStateError(f"--minutes {self.minutes} must be > 0")
        if self.tokens is not None and self.tokens < 1:
            raise KVStateError(f"--tokens {self.tokens} must be >= 1")
        if self.length < 64 or self.length & (self.length - 1):
            raise KVStateError(f"--length {self.length} must be a power of two >= 64")


def _routing_factory(cfg: DepthTrainConfig, pattern: SharingPattern | None) -> Any:
    def factory(model: Any) -> Any:
        import torch

        from kvstate.depth.attention import layer_specs, routed
        from kvstate.depth.routing import StochasticKVRouting

        if pattern is not None:
            pattern.validate(layer_specs(model.config))
            return routed(model, lambda: pattern)  # not apply_sharing: saves must not carry kv_sharing_modes
        dist = torch.distributed
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        routing = StochasticKVRouting(model, cfg.p, seed=cfg.seed + rank)
        factory.routing = routing  # type: ignore[attr-defined]
        return routing
    return factory


def depth_train(model_dir: str | Path, out_dir: str | Path, cfg: DepthTrainConfig, *, resume: bool = False,
                overrides: dict[str, Any] | None = None, progress: bool = True, log: Any = print,
                overwrite: bool = False) -> dict[str, Any]:
    """Train ``model_dir`` (a ``kvstate train`` output) with routing into ``out_dir``; returns the state.

    ``resume=True`` continues the run already in ``out_dir`` (same routing, budget counted afresh);
    ``overwrite`` replaces an ``out_dir`` that holds other output (refused otherwise).
    """
    from kvstate.depth.patterns import parse_pattern
    from kvstate.lab.training.train import TrainConfig, load_state, train

    start = Path(out_dir) if resume else Path(model_dir)
    state = load_state(start)
    prev = state.get(DEPTH_KEY)
    pattern = parse_pattern(cfg.pattern) if cfg.pattern is not None else None
    base = {k: v for k, v in state["config"].items() if k not in ("minutes", "max_steps", "resume_length")}
    fields = {**base, **FINE_TUNE, "max_length": cfg.length, **(overrides or {})}
    fields["resume_length"] = None if resume else cfg.length
    fields["start_length"] = min(int(fields["start_length"]), cfg.length)
    steps = math.ceil(cfg.tokens / int(fields["tokens_per_step"])) if cfg.tokens is not None else None
    tcfg = TrainConfig(**{**fields, "minutes": cfg.minutes or 24 * 60.0, "max_steps": steps})
    factory = _routing_factory(cfg, pattern)
    result = train(tcfg, out_dir, resume=start, progress=progress, log=log, context=factory, overwrite=overwrite)
    routing = getattr(factory, "routing", None)
    counts = dict(routing.counts()) if routing is not None else {}
    if resume and prev is not None:
        entry = prev
    else:  # a first part (or one killed before its first save with this entry): start counts from the model
        origin = load_state(model_dir)
        entry = {"start": str(model_dir), "start_step": int(origin["step"]), "start_tokens": int(origin["tokens"]),
                 "parts": []}
    entry.update(p=None if pattern else cfg.p, pattern=format_pattern(pattern) if pattern else None, seed=cfg.seed)
    entry["parts"].append({"to_step": result["step"], "tokens": result["tokens"], "draw_counts": counts})
    result[DEPTH_KEY] = entry
    _write_state(Path(out_dir), result)
    return result


def _write_state(out: Path, state: dict[str, Any]) -> None:
    import torch

    from kvstate.integrity import MANIFEST, refresh_manifest
    from kvstate.io_safety import write_text_atomic
    from kvstate.lab.training.io import STATE_FILE

    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    write_text_atomic(out / STATE_FILE, json.dumps(state, indent=1))
    if (out / MANIFEST).is_file():  # the training state changed after kvstate train wrote its checksums
        refresh_manifest(out)


__all__ = ["DEPTH_KEY", "DepthTrainConfig", "depth_train"]
