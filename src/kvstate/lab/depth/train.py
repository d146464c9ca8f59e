"""Continue training a reference model with Random Cross-Layer Attention ("Stochastic KV Routing").

The loop is :func:`kvstate.lab.training.train.train` (curriculum tools, answer-weighted loss, resumable saves,
DDP under ``torchrun``); this module only wraps it in a routing context: stochastic routing with
probability ``p`` (R-CLA; ``p = 1`` is the no-routing control), or one fixed pattern at every step
(a specialist, e.g. CLA2 ``0_0_2_2``, always sharing as at deployment). Each DDP rank draws its own
routes (seed + rank); ``rule`` picks the paper's draw (``paper``: any earlier layer's own K/V) or the
ablated ``owner`` variant (:mod:`kvstate.depth.routing`). Options for keeping retrieval under sharing, each
recorded in the ``depth`` entry: ``p_layer`` (a probability per layer; a layer at 1 is never routed, and the
deployment family declared from it is recorded with its patterns per kept fraction), ``distill`` (weight of the
KL to the same model's own-KV pass in the same step, :mod:`kvstate.depth.distill`), ``p_schedule="anneal"``
(p from 1 to the target over the first ``anneal_frac`` of the steps — needs a token budget — or over
``anneal_tokens`` tokens, which lets one anneal span a run trained in parts of a few ``--tokens`` each) and
``retrieval_share`` (the needle tasks' share of the training rows). A run starts from a ``kvstate train`` output
directory (a reference model) at a fixed length and a constant learning rate after a warm-up that counts
from the run's first step, so runs with the same ``tokens`` see the same batches; ``training_state.json``
gains a ``depth`` entry (start model, routing, draw counts). A resumed part continues the routing draws
(the loop saves the routing's state) and the schedule, and is refused when its routing settings differ
from the recorded ones.

The output rule (:mod:`kvstate.io_safety`): ``--out`` is never the start model (nor inside it, nor
holding it), a directory holding anything but a model is never written into, an existing one is
replaced only with ``overwrite``; ``resume`` continues only a depth run — one whose saved state has the
``depth`` entry, or (after an interrupted first part) periodic saves with this command's fine-tune
settings — at the recorded length. Rows are bounded by the model's ``max_position_embeddings``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstate.depth.patterns import (
    PatternError,
    SharingPattern,
    check_p,
    check_p_layer,
    format_pattern,
    parse_pattern,
)
from kvstate.depth.registry import RULES
from kvstate.errors import KVStateError
from kvstate.io_safety import write_bytes_atomic
from kvstate.validate import check_float, check_int

DEPTH_KEY = "depth"
# what a depth run changes in the start model's TrainConfig: one length, constant lr, no curriculum moves
FINE_TUNE = {"lr": 3e-4, "decay_fraction": 0.0, "warmup_steps": 20, "warmup_per_part": False,
             "stage_patience_min": 1e6, "threads": 1, "save_every_min": 3.0}
# a recorded depth entry without a rule was drawn before the paper's rule existed: owner draws
LEGACY_RULE = "owner"
MAX_MINUTES = 7 * 24 * 60.0  # a week: a longer budget is a typo, not a plan
MAX_TOKENS = 10**12
RESULT_FILES = ("depth_eval.json",)
SCHEDULES = ("constant", "anneal")
# the needle tasks of kvstate.lab.training.config.TASK_MIX: what --retrieval-share scales
RETRIEVAL_PREFIX = "niah_"
# what a depth entry recorded before these options existed had: no per-layer p, no distillation, constant p
OPTION_DEFAULTS = {"p_layer": None, "distill": 0.0, "p_schedule": "constant", "anneal_frac": None,
                   "anneal_tokens": None, "retrieval_share": None}  # kvstate.lab.depth.card.EVAL_FILE: results appended next to a run


@dataclass(frozen=True)
class DepthTrainConfig:
    p: float = 0.5  # probability of a layer's own K/V per pass (1: no routing); ignored with a pattern
    pattern: str | None = None  # a fixed sharing pattern at every step, e.g. "0_0_2_2" (CLA2)
    length: int = 1024  # tokens per row (the curriculum stays here; shorter_share replays shorter ones)
    minutes: float | None = None  # wall-clock budget
    tokens: int | None = None  # token budget: tokens // tokens_per_step steps (same batches for every run)
    seed: int = 0  # routing seed (rank r draws with seed + r)
    rule: str = "paper"  # "paper" (any earlier layer's own K/V) or "owner" (an earlier owner; ablation)
    p_layer: tuple[float, ...] | None = None  # per-layer p (replaces p); one per layer, checked against the model
    distill: float = 0.0  # weight of the KL to the own-KV pass (0: no teacher pass)
    p_schedule: str = "constant"  # "constant" or "anneal" (p from 1 to the target over anneal_frac of the steps)
    anneal_frac: float = 0.25  # share of the run's steps the anneal takes (used with p_schedule="anneal")
    retrieval_share: float | None = None  # share of the needle tasks in the training rows (None: the start model's mix)
    anneal_tokens: int | None = None  # the anneal's horizon in tokens (replaces anneal_frac; spans parts of a run)

    def __post_init__(self) -> None:
        try:
            check_p(self.p)
        except PatternError:
            raise PatternError(f"--p {self.p!r} must be a number in [0, 1] (1: every layer keeps its own K/V)") from None
        RULES.get(self.rule)  # an unknown rule is refused listing the registry
        if self.minutes is None and self.tokens is None:
            raise KVStateError("depth train: pass --minutes M or --tokens N (the training budget)")
        if self.minutes is not None:
            check_float("--minutes", self.minutes, 0.0, MAX_MINUTES, lo_open=True, error=KVStateError)
        if self.tokens is not None:
            check_int("--tokens", self.tokens, 1, MAX_TOKENS, error=KVStateError)
        check_int("--length", self.length, 64, 2**20, error=KVStateError, hint="; pass a power of two >= 64")
        if self.length & (self.length - 1):
            raise KVStateError(f"--length {self.length} must be a power of two >= 64")
        check_int("--seed", self.seed, 0, 2**31 - 1, error=KVStateError)
        if self.pattern is not None and not isinstance(self.pattern, str):
            raise PatternError(f"--pattern {self.pattern!r} must be a string such as 0_0_2_2")
        if self.p_layer is not None:
            check_p_layer(self.p_layer, len(self.p_layer))  # the length is checked against the model's layers later
        if isinstance(self.distill, bool) or not isinstance(self.distill, (int, float)) or not (
                0.0 <= self.distill <= 1e3):
            raise KVStateError(f"--distill {self.distill!r} must be a weight >= 0 (0: no distillation), e.g. 1")
        if self.p_schedule not in SCHEDULES:
            raise KVStateError(f"--p-schedule {self.p_schedule!r} is unknown; choose one of {', '.join(SCHEDULES)}")
        check_float("--anneal-frac", self.anneal_frac, 0.0, 1.0, lo_open=True, error=KVStateError)
        if self.anneal_tokens is not None:
            check_int("--anneal-tokens", self.anneal_tokens, 1, MAX_TOKENS, error=KVStateError)
            if self.p_schedule != "anneal":
                raise KVStateError("--anneal-tokens sets the anneal's horizon: pass it with --p-schedule anneal")
        if self.p_schedule == "anneal" and self.tokens is None and self.anneal_tokens is None:
            raise KVStateError("--p-schedule anneal counts steps: pass --tokens N or --anneal-tokens N (not only --minutes)")
        if self.retrieval_share is not None:
            check_float("--retrieval-share", self.retrieval_share, 0.0, 1.0, lo_open=True, error=KVStateError)
        if self.pattern is not None and (self.p_layer is not None or self.distill or self.p_schedule != "constant"):
            raise KVStateError("--pattern trains one fixed pattern: drop --p-layer / --distill / --p-schedule, or drop "
                               "--pattern to route stochastically")


class DistilledRouting:
    """Stochastic routing plus self-distillation for the training loop: routes like the routing it wraps
    (state included, so resume continues the draws) and adds ``weight`` x KL(own-KV pass || routed pass)
    (:class:`kvstate.lab.training.train.AuxiliaryLoss`)."""

    def __init__(self, routing: Any, weight: float) -> None:
        self.routing = routing
        self.weight = float(weight)

    def state_dict(self) -> dict[str, Any]:
        return self.routing.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.routing.load_state_dict(state)

    def counts(self) -> Any:
        return self.routing.counts()

    def auxiliary_loss(self, model: Any, ids: Any, weights: Any, logits: Any) -> Any:
        from kvstate.depth.distill import distillation_loss, own_kv_logits

        last = self.routing.draws[-1] if self.routing.draws else None
        if last is not None and last.sources == tuple(range(len(last.sources))):
            return logits.new_zeros(())  # the step's own route kept every layer's K/V: it is the teacher pass
        teacher = own_kv_logits(model, self.routing, ids)  # (B, T, V)
        # position t predicts token t+1, whose training weight is weights[:, t+1]
        return self.weight * distillation_loss(logits[:, :-1], teacher[:, :-1], weights[:, 1:])

    def __enter__(self) -> DistilledRouting:
        self.routing.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.routing.__exit__(*exc)


def _routing_factory(cfg: DepthTrainConfig, pattern: SharingPattern | None, anneal_steps: int = 0) -> Any:
    def factory(model: Any) -> Any:
        import torch

        from kvstate.depth.attention import layer_specs, routed
        from kvstate.depth.routing import StochasticKVRouting

        if pattern is not None:
            pattern.validate(layer_specs(model.config))
            return routed(model, lambda: pattern)  # not apply_sharing: saves must not carry kv_sharing_modes
        dist = torch.distributed
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        routing = StochasticKVRouting(model, cfg.p, seed=cfg.seed + rank, rule=cfg.rule, p_layer=cfg.p_layer,
                                      anneal_steps=anneal_steps)
        factory.routing = routing  # type: ignore[attr-defined]
        return DistilledRouting(routing, cfg.distill) if cfg.distill > 0 else routing
    return factory


def routing_settings(cfg: DepthTrainConfig) -> dict[str, Any]:
    """What a depth entry records about the routing (``p`` and ``rule`` are None for a fixed pattern, ``p`` is
    None with ``p_layer``) and the options that keep retrieval (:data:`OPTION_DEFAULTS` when unused)."""
    options = {"p_layer": None if cfg.p_layer is None else [float(v) for v in cfg.p_layer], "distill": float(cfg.distill),
               "p_schedule": cfg.p_schedule,
               "anneal_frac": cfg.anneal_frac if cfg.p_schedule == "anneal" and cfg.anneal_tokens is None else None,
               "anneal_tokens": cfg.anneal_tokens, "retrieval_share": cfg.retrieval_share}
    if cfg.pattern is not None:
        return {"p": None, "pattern": format_pattern(parse_pattern(cfg.pattern)), "seed": cfg.seed, "rule": None,
                **options}
    return {"p": None if cfg.p_layer is not None else float(cfg.p), "pattern": None, "seed": cfg.seed, "rule": cfg.rule,
            **options}


FLAGS = {"p_layer": "--p-layer", "distill": "--distill", "p_schedule": "--p-schedule", "anneal_frac": "--anneal-frac",
         "anneal_tokens": "--anneal-tokens",
         "retrieval_share": "--retrieval-share"}


def _flag(key: str, value: Any) -> str:
    if isinstance(value, list):
        value = ",".join(f"{v:g}" for v in value)
    return f"{FLAGS.get(key, '--' + key)} {value}"


def declared_family_record(layers: Any, cfg: DepthTrainConfig) -> dict[str, Any] | None:
    """The deployment family a stochastic run declares: its per-layer p, the layers that always own their K/V,
    and the family's patterns per kept fraction (counts only past 64 patterns); None for a fixed pattern."""
    from kvstate.depth.patterns import declared_family, kept_fraction

    if cfg.pattern is not None:
        return None
    ps = check_p_layer(cfg.p_layer if cfg.p_layer is not None else (cfg.p,) * len(layers), len(layers))
    family = declared_family(layers, ps)
    record: dict[str, Any] = {"p_layer": list(ps), "always_own": [i for i, v in enumerate(ps) if v == 1.0]}
    if family is None:
        record.update(patterns=None, by_keep=None)
        return record
    by_keep: dict[str, list[str]] = {}
    for pat in family:
        by_keep.setdefault(f"{kept_fraction(pat, layers):g}", []).append(format_pattern(pat))
    record["patterns"] = len(family)
    record["by_keep"] = {k: (v if len(family) <= 64 else len(v)) for k, v in sorted(by_keep.items(), reverse=True)}
    return record


def retrieval_mix(mix: dict[str, float], share: float) -> dict[str, float]:
    """``mix`` with the needle tasks rescaled to ``share`` of the rows and the rest to ``1 - share`` (each group's
    internal proportions kept)."""
    total = sum(mix.values())
    needle = sum(v for t, v in mix.items() if t.startswith(RETRIEVAL_PREFIX))
    other = total - needle
    if needle <= 0 or (share < 1 and other <= 0):
        raise KVStateError(f"--retrieval-share {share:g}: the training mix {mix} cannot be rescaled (it needs needle "
                           "tasks and, below 1, other tasks); set the mix with --set task_mix=...")
    return {t: round((share * v / needle if t.startswith(RETRIEVAL_PREFIX) else (1 - share) * v / other) * total, 6)
            for t, v in mix.items()}


def check_resume(recorded: dict[str, Any], cfg: DepthTrainConfig, out: str | Path) -> None:
    """Refuse a resume whose routing settings (p, pattern, seed, rule, the retrieval options) differ from the
    recorded run's."""
    old = {"p": recorded.get("p"), "pattern": recorded.get("pattern"), "seed": recorded.get("seed", 0),
           "rule": recorded.get("rule", LEGACY_RULE if recorded.get("pattern") is None else None),
           **{k: recorded.get(k, v) for k, v in OPTION_DEFAULTS.items()}}
    new = routing_settings(cfg)
    diff = [k for k in ("p", "pattern", "seed", "rule", *OPTION_DEFAULTS) if old[k] != new[k]]
    if diff:
        was = ", ".join(f"{k}={old[k]!r}" for k in diff)
        now = ", ".join(f"{k}={new[k]!r}" for k in diff)
        flags = " ".join(_flag(k, old[k]) for k in diff if old[k] is not None)
        raise KVStateError(f"depth train --resume: {str(out)!r} was trained with {was} but this command asks for "
                           f"{now}; a resumed run must keep its routing — pass {flags or 'the recorded settings'}, "
                           "or train into a new --out")


def _resume_dir(out: Path, cfg: DepthTrainConfig) -> Path:
    """The newest save of the depth run in ``out``: its periodic saves if a part was interrupted, else ``out``;
    refused when there is none, or when ``out`` holds another kind of run or another length."""
    from kvstate.lab.training.io import STATE_FILE, load_state, partial_dir

    partial = partial_dir(out)
    has_out, has_partial = (out / STATE_FILE).is_file(), (partial / STATE_FILE).is_file()
    if not has_out and not has_partial:
        raise KVStateError(f"depth train --resume: nothing to resume in {str(out)!r} (no {STATE_FILE} there nor in "
                           f"{str(partial)!r}); start the run without --resume")
    if has_out and DEPTH_KEY not in load_state(out):
        raise KVStateError(f"depth train --resume: {str(out)!r} is not a depth run (its {STATE_FILE} has no "
                           f"{DEPTH_KEY!r} entry: a kvstate train output or a reference model); --resume continues "
                           "only a kvstate depth train --out directory — pass a new --out without --resume")
    start = partial if has_partial else out  # train() removes the partial directory when a part completes
    recorded = load_state(start)["config"]
    signature = {k: FINE_TUNE[k] for k in ("decay_fraction", "stage_patience_min")}
    if not has_out and any(recorded.get(k) != v for k, v in signature.items()):
        raise KVStateError(f"depth train --resume: the periodic saves in {str(partial)!r} are not a depth run's "
                           f"(settings {', '.join(f'{k}={recorded.get(k)!r}' for k in signature)}); resume them with "
                           "kvstate train --resume, or start a new depth run")
    if recorded.get("max_length") != cfg.length:
        raise KVStateError(f"depth train --resume: {str(out)!r} trains at --length {recorded.get('max_length')}, "
                           f"this command asks for {cfg.length}; a resumed run keeps its length — pass --length "
                           f"{recorded.get('max_length')}")
    return start


def check_outputs(model_dir: Path, out: Path, cfg: DepthTrainConfig, *, resume: bool, overwrite: bool) -> Path:
    """Every refusal a depth run can meet before any work: the output rule, the resume kind, ``--p-layer``
    against the start model's layers, the row length against its positions. Returns the directory training starts from."""
    from kvstate.integrity import accepts_kind
    from kvstate.io_safety import check_not_input, check_output_dir
    from kvstate.models.families import text_config
    from kvstate.models.loading import load_config

    check_not_input(out, {"--model": model_dir})
    check_output_dir(out, overwrite=overwrite or resume, accept=accepts_kind("model"),
                     kind="a model directory (a depth run's output)")
    start = _resume_dir(out, cfg) if resume else model_dir
    config = load_config(model_dir)
    if cfg.p_layer is not None:
        from kvstate.depth.attention import layer_specs

        check_p_layer(cfg.p_layer, len(layer_specs(config)))
    limit = getattr(text_config(config), "max_position_embeddings", None)
    if isinstance(limit, int) and cfg.length > limit:
        raise KVStateError(f"--length {cfg.length:,} exceeds the max_position_embeddings={limit:,} of {str(model_dir)!r}; "
                           f"pass --length <= {limit:,}")
    return start


def depth_train(model_dir: str | Path, out_dir: str | Path, cfg: DepthTrainConfig, *, resume: bool = False,
                overrides: dict[str, Any] | None = None, progress: bool = True, log: Any = print,
                overwrite: bool = False, stop_at_step: int | None = None) -> dict[str, Any]:
    """Train ``model_dir`` (a ``kvstate train`` output) with routing into ``out_dir``; returns the state.

    ``resume=True`` continues the run already in ``out_dir`` (or its periodic saves when a part was
    interrupted): same routing (refused otherwise), the routing draws and the warm-up continue, the
    budget is counted afresh.
    ``overwrite`` replaces an ``out_dir`` that holds other output (refused otherwise).
    ``stop_at_step``: the part stops there as an interrupted part did (its periodic save written, nothing of
    ``out_dir``; :class:`~kvstate.lab.training.train.PartStopped` raised).
    """
    from kvstate.depth.attention import layer_specs
    from kvstate.lab.training.config import TASK_MIX
    from kvstate.lab.training.io import STATE_FILE
    from kvstate.lab.training.train import TrainConfig, load_state, train
    from kvstate.models.loading import load_config

    out = Path(out_dir)
    pattern = parse_pattern(cfg.pattern) if cfg.pattern is not None else None
    start = check_outputs(Path(model_dir), out, cfg, resume=resume, overwrite=overwrite)
    state = load_state(start)
    # the run's own history lives in out (a first part's periodic saves carry only the start model's state)
    prev = load_state(out).get(DEPTH_KEY) if resume and (out / STATE_FILE).is_file() else None
    if prev is not None:
        check_resume(prev, cfg, out)
    base = {k: v for k, v in state["config"].items() if k not in ("minutes", "max_steps", "resume_length")}
    fields = {**base, **FINE_TUNE, "max_length": cfg.length, **(overrides or {})}
    fields["resume_length"] = None if resume else cfg.length
    fields["start_length"] = min(int(fields["start_length"]), cfg.length)
    if cfg.retrieval_share is not None:
        mix = fields.get("task_mix") or dict(TASK_MIX)
        fields["task_mix"] = retrieval_mix(dict(mix), cfg.retrieval_share)
    steps = math.ceil(cfg.tokens / int(fields["tokens_per_step"])) if cfg.tokens is not None else None
    tcfg = TrainConfig(**{**fields, "minutes": cfg.minutes or 24 * 60.0, "max_steps": steps})
    layers = layer_specs(load_config(Path(model_dir)))  # check_outputs checked --p-layer against them
    family = declared_family_record(layers, cfg)
    # the anneal spans anneal_tokens, or a share of the first part's steps; a resumed part keeps the recorded horizon
    if prev is not None:
        anneal_steps = int(prev.get("anneal_steps", 0))
    else:
        anneal_steps = anneal_horizon(cfg, steps, int(fields["tokens_per_step"]))
    factory = _routing_factory(cfg, pattern, anneal_steps)
    # a resumed part replaces out whole: its evaluation results are carried over, never dropped
    kept = {n: (out / n).read_bytes() for n in RESULT_FILES if resume and (out / n).is_file()}
    result = train(tcfg, out, resume=start, progress=progress, log=log, context=factory,
                   overwrite=overwrite or resume, stop_at_step=stop_at_step)
    for name, data in kept.items():
        write_bytes_atomic(out / name, data)
    routing = getattr(factory, "routing", None)
    counts = dict(routing.counts()) if routing is not None else {}
    if prev is not None:
        entry = prev
    else:  # a first part (or one killed before its first save with this entry): start counts from the model
        origin = load_state(model_dir)
        entry = {"start": str(model_dir), "start_step": int(origin["step"]), "start_tokens": int(origin["tokens"]),
                 "parts": []}
    entry.update(routing_settings(cfg))
    entry["anneal_steps"] = anneal_steps
    entry["family"] = family
    entry["parts"].append({"to_step": result["step"], "tokens": result["tokens"], "draw_counts": counts})
    result[DEPTH_KEY] = entry
    _write_state(out, result)
    return result


def anneal_horizon(cfg: DepthTrainConfig, steps: int | None, tokens_per_step: int) -> int:
    """Steps (= routing draws) over which p anneals from 1: ``anneal_tokens`` in steps when given, else
    ``anneal_frac`` of this part's ``steps``; 0 with a constant schedule."""
    if cfg.p_schedule != "anneal":
        return 0
    if cfg.anneal_tokens is not None:
        return math.ceil(cfg.anneal_tokens / tokens_per_step)
    return round(cfg.anneal_frac * steps) if steps else 0


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


__all__ = ["DEPTH_KEY", "SCHEDULES", "DepthTrainConfig", "DistilledRouting", "anneal_horizon", "check_outputs",
           "check_resume", "declared_family_record", "depth_train", "retrieval_mix", "routing_settings"]
