"""Training the reference models (``models/ref-attn``, ``models/ref-hybrid``) on the synthetic tasks.

Recipe (measured on a 2-core CPU): bf16 autocast + SDPA, AdamW at lr 1e-3, answer tokens
weighted x10, and a *context-length curriculum* that starts at 64 tokens and doubles the length
whenever the gate tasks (``niah_single``, ``niah_multikey``) pass ``advance_at`` first-answer-token
accuracy (or whole-answer exact match, ``advance_metric="exact"``), or after ``stage_patience_min``
once their mean passes ``patience_floor`` (0 by default: the probe behind the reference models solved single-needle
retrieval at 1K only after most of its training at 1K, and a strict gate at 128 tokens stalled here for
10 minutes). A ``shorter_share`` of the steps replays an earlier stage's length. Both are measured on each fresh training batch *before* the
update, row by row: exact match counts a row when every answer token is the argmax under teacher
forcing, which is exactly when greedy decoding reproduces the target (by induction over the answer),
so it is the eval metric for free; the first answer token (which needle) cannot be copied from the
answer itself. Per-token teacher-forced accuracy is not used: once the first digit is given, the
rest is a copy, and it reads 0.85 while multi-key retrieval is at chance.

Training-only drills (:mod:`kvstate.lab.workloads.drills`, ``niah_drill`` and ``copy`` in :data:`TASK_MIX`)
carry many retrievals and copies per row; restarting a resumed run at 256 tokens with them
(``resume_length``) is what lifted both reference models past the 0.9 gate (their cards have the curves).
Multi-needle documents are mixed in from the first stage: at 64 tokens the multi-needle tasks use
two needles instead of four (:func:`stage_task_config`). Training is resumable: every save writes the
model, the tokenizer, ``training_state.json`` (curriculum stage, step, learning curve) and
``optimizer.safetensors``; ``resume=DIR`` continues from them. The hybrid can start from a trained attention
model (``init_from``): tensors whose names and shapes match are copied (embeddings, MLPs, norms,
attention q/k/v/o) and the Gated DeltaNet output projections start at zero, so the hybrid starts from
a working token representation instead of random residual noise.
Under ``torchrun`` (a ``torch.distributed`` process group already initialised, gloo on CPU) the model
is wrapped in DistributedDataParallel; rank ``r`` of ``w`` trains on the batches of data steps
``step * w + r`` and rank 0 decides stopping and curriculum moves, broadcast so ranks stay in step;
only rank 0 saves. ``context(model)`` (optional) wraps the whole loop, e.g. in stochastic KV routing;
when the context object has ``state_dict()`` / ``load_state_dict()`` (:class:`ResumableContext`), every
save (periodic ones too) records each rank's state under ``context_state`` and a part that continues the
same run (``resume`` is ``out`` or its partial directory) loads it back, so routing draws continue where
they stopped; when it has ``auxiliary_loss()`` (:class:`AuxiliaryLoss`, e.g. self-distillation under routing)
its term is added to each step's loss and logged as ``aux`` in the learning curve. With ``warmup_per_part=False`` the warm-up counts from the run's first step
(``warmup_start`` in the state) instead of restarting with every part. Ignored: mixed lengths within one batch.
"""

from __future__ import annotations

import json
import math
import shlex
import sys
import time
from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
import transformers as tf

from kvstate.integrity import accepts_kind
from kvstate.io_safety import check_not_input, check_output_dir
from kvstate.lab.training.config import (
    ARCHS,
    COPY,
    DRILL,
    GATE_TASKS,
    TASK_MIX,
    TrainConfig,
)
from kvstate.lab.training.init_from import init_from_model as _init_from
from kvstate.lab.training.io import (
    OPTIM_FILE,
    TrainError,
    drop_partial,
    load_state,
    partial_dir,
    save_run,
)
from kvstate.lab.training.objective import _lr, answer_stats, weighted_loss
from kvstate.lab.training.optim_io import load_optimizer as _load_optimizer
from kvstate.lab.workloads.drills import copy_batch, drill_batch
from kvstate.lab.workloads.tasks import TaskConfig, training_batch
from kvstate.lab.workloads.tokenizer import build_tokenizer


def model_config(cfg: TrainConfig, vocab_size: int, tokenizer: Any) -> Any:
    """The transformers config of ``cfg.arch``: Qwen3 (attention) or Qwen3.5 text (hybrid)."""
    common = {"vocab_size": vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
              "num_hidden_layers": cfg.layers, "num_attention_heads": cfg.num_heads,
              "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.hidden_size // cfg.num_heads,
              "max_position_embeddings": 2 * cfg.max_length if cfg.max_length >= 4096 else 8192,
              "tie_word_embeddings": True, "pad_token_id": tokenizer.pad_token_id,
              "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    if cfg.arch == "attn":
        return tf.Qwen3Config(**common)
    heads = cfg.num_heads
    # full rotary (Qwen3.5 defaults to 0.25) so attention weights copied from ref-attn see the same positions
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}
    return tf.Qwen3_5TextConfig(**common, rope_parameters=rope, full_attention_interval=4, linear_num_key_heads=heads,
                                linear_num_value_heads=heads, linear_key_head_dim=cfg.hidden_size // heads,
                                linear_value_head_dim=cfg.hidden_size // heads, linear_conv_kernel_dim=4)


def stage_task_config(length: int) -> TaskConfig:
    """Task sizes of a curriculum stage: two needles instead of four below 128 tokens, so they fit."""
    return TaskConfig(n_keys=2, n_values=2, n_queries=2, vt_hops=2, vt_chains=1) if length < 128 else TaskConfig()


_FITS: dict[int, set[str]] = {}  # length -> tasks that fit (the tokenizer is always build_tokenizer's)


def _rows(task: str, length: int, count: int, seed: int, tokenizer: Any,
          answer_weight: float = 10.0) -> tuple[np.ndarray, np.ndarray]:
    if task == DRILL:
        return drill_batch(length, count, seed, tokenizer, answer_weight=answer_weight)
    if task == COPY:
        return copy_batch(length, count, seed, tokenizer, answer_weight=answer_weight,
                          max_items=min(24, (length - 16) // 2))
    return training_batch([task], length, count, seed, tokenizer, answer_weight=answer_weight,
                          config=stage_task_config(length))


def stage_tasks(length: int, tokenizer: Any, mix: dict[str, float] | None = None) -> dict[str, float]:
    """The tasks of ``mix`` (default :data:`TASK_MIX`) that fit rows of ``length`` tokens, with their shares."""
    if length not in _FITS:
        fits = set()
        for task in TASK_MIX:
            try:
                _rows(task, length, 1, 0, tokenizer)
            except ValueError:
                continue
            fits.add(task)
        _FITS[length] = fits
    return {t: v for t, v in (mix or TASK_MIX).items() if t in _FITS[length] and v > 0}


def make_batch(cfg: TrainConfig, length: int, step: int, tokenizer: Any) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """A training batch for ``step``: rows split over the stage's tasks, deterministic in (seed, step)."""
    tasks = stage_tasks(length, tokenizer, cfg.mix)
    names, shares = list(tasks), np.array(list(tasks.values()))
    rng = np.random.default_rng([cfg.seed, step, 7])
    rows = rng.choice(len(names), size=cfg.batch_for(length), p=shares / shares.sum())
    ids, weights, row_tasks = [], [], []
    data_seed = cfg.seed * 1_000_003 + step  # disjoint from generate(): training_batch uses its own stream
    for k, task in enumerate(names):
        count = int((rows == k).sum())
        if count:
            i, w = _rows(task, length, count, data_seed, tokenizer, cfg.answer_weight)
            ids.append(i)
            weights.append(w)
            row_tasks += [task] * count
    return torch.from_numpy(np.concatenate(ids)), torch.from_numpy(np.concatenate(weights)), row_tasks


CONTEXT_KEY = "context_state"  # training-state key: one context state_dict() per DDP rank


@runtime_checkable
class ResumableContext(Protocol):
    """A ``context(model)`` object whose state a resumed run continues (e.g. stochastic KV routing)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@runtime_checkable
class AuxiliaryLoss(Protocol):
    """A ``context(model)`` object that adds a term to each step's loss from the batch and its logits."""

    def auxiliary_loss(self, model: Any, ids: torch.Tensor, weights: torch.Tensor,
                       logits: torch.Tensor) -> torch.Tensor: ...


def _context_states(scope: Any, ddp: bool, world: int) -> dict[str, Any]:
    """``{CONTEXT_KEY: [state of rank 0, rank 1, ...]}`` (a collective under DDP), or ``{}`` without one."""
    if not isinstance(scope, ResumableContext):
        return {}
    own = scope.state_dict()
    if not ddp:
        return {CONTEXT_KEY: [own]}
    gathered: list[Any] = [None] * world
    torch.distributed.all_gather_object(gathered, own)
    return {CONTEXT_KEY: gathered}


def _restore_context(scope: Any, saved: Any, rank: int, world: int, where: str | Path) -> None:
    if saved is None:
        return
    if not isinstance(scope, ResumableContext):
        raise TrainError(f"{str(where)!r} saved a training context state (e.g. routing draws) but this run's context "
                         "cannot take it; resume with the same routing settings")
    if not isinstance(saved, list) or len(saved) != world:
        count = len(saved) if isinstance(saved, list) else "?"
        raise TrainError(f"{str(where)!r} was saved by {count} training processes, this part runs {world}; resume "
                         f"with --nproc_per_node {count} so every rank continues its own draws")
    scope.load_state_dict(saved[rank])


def train(cfg: TrainConfig, out_dir: str | Path, *, resume: str | Path | None = None,
          init_from: str | Path | None = None, progress: bool = True, log: Any = print,
          overwrite: bool = False, context: Callable[[Any], AbstractContextManager[Any]] | None = None,
          stop_at_step: int | None = None) -> dict[str, Any]:
    """Train ``cfg.arch`` for ``cfg.minutes`` (or ``cfg.max_steps``) and save to ``out_dir``; returns the state.

    ``resume`` continues a saved run (model, optimizer, curriculum stage, step); ``init_from`` seeds a new
    hybrid from a trained attention model. The returned state holds the learning curve. An ``out_dir``
    that already holds files is refused unless ``overwrite`` (or it is the ``resume`` directory itself);
    it is replaced whole only when the run completes (:mod:`kvstate.lab.training.io`). A non-finite loss,
    gradient or weight stops the run with :class:`TrainError` and saves nothing. ``context(model)`` wraps
    the loop (hooks on the model, e.g. routing). ``stop_at_step`` stops the part after that global step as an
    interrupted part stops: its periodic save written at that step, ``out`` not, and :class:`PartStopped` raised
    (the replay of a part that was stopped early and resumed from its periodic save, ``kvstate lab retrain``).
    """
    from kvstate.lab.progress import progress_bar
    from kvstate.models.loading import load_model

    out = Path(out_dir)
    same = resume is not None and Path(resume).resolve() == out.resolve()
    # the same run continues (its draws and lr schedule): resuming from out or its periodic saves
    continuing = resume is not None and Path(resume).resolve() in (out.resolve(), partial_dir(out).resolve())
    if init_from is not None:
        check_not_input(out, {"--init-from": init_from})
    # before any work: refuse, or fail fast if unwritable; a router / codec / other directory is never written into
    check_output_dir(out, overwrite=overwrite or same, accept=accepts_kind("model"), kind="a model directory")
    torch.set_num_threads(cfg.threads)
    dist = torch.distributed
    ddp = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if ddp else (0, 1)
    progress, log = progress and rank == 0, log if rank == 0 else (lambda *_: None)
    tokenizer = build_tokenizer()
    if resume is not None:
        state = load_state(resume)
        if state["config"]["arch"] != cfg.arch:
            raise TrainError(f"resume directory {str(resume)!r} holds a {state['config']['arch']!r} run, not "
                             f"{cfg.arch!r}; pass --arch {state['config']['arch']}")
        model = load_model(resume, torch.float32)
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            model = tf.AutoModelForCausalLM.from_config(model_config(cfg, len(tokenizer), tokenizer))
        state = {"step": 0, "tokens": 0, "seconds": 0.0, "length": cfg.start_length, "curve": [], "stages": [],
                 "params": sum(p.numel() for p in model.parameters()), "init_from": None}
        if init_from is not None:
            state["init_from"] = {"dir": str(init_from), "tensors": _init_from(model, Path(init_from))}
            log(f"init_from {init_from}: copied {state['init_from']['tensors']} tensors")
    state["config"] = asdict(cfg)
    # every part's exact command, so `kvstate lab retrain` can replay the run (see kvstate.lab.training.retrain)
    state.setdefault("commands", []).append(part_record(out, resume, int(state["step"])))
    model.config.dtype = "float32"
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    if resume is not None and (Path(resume) / OPTIM_FILE).is_file():
        try:
            optimizer.load_state_dict(_load_optimizer(Path(resume) / OPTIM_FILE))
        except (ValueError, KeyError) as exc:
            raise TrainError(f"{str(Path(resume) / OPTIM_FILE)!r} does not fit this model ({exc}); resume from the "
                             "run that wrote it") from None
    windows = {t: deque(maxlen=cfg.window) for t in TASK_MIX}
    first_windows = {t: deque(maxlen=cfg.window) for t in TASK_MIX}
    if resume is not None and cfg.resume_length is not None:
        state["length"] = cfg.resume_length
    length, step0, t_start = int(state["length"]), int(state["step"]), time.monotonic()
    # where warm-up counts from: this part's first step, or (warmup_per_part=False) the run's first step
    keep_schedule = continuing and not cfg.warmup_per_part and isinstance(state.get("warmup_start"), int)
    warm0 = int(state["warmup_start"]) if keep_schedule else step0
    state["warmup_start"] = warm0
    stage_start, last_save, budget = t_start, t_start, cfg.minutes * 60
    losses: list[float] = []
    aux_losses: list[float] = []
    # non-owner layers of a routed pass leave their K/V projections unused: DDP must allow that
    net = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True) if ddp else model
    scope = context(model) if context is not None else nullcontext()
    saved_context = state.pop(CONTEXT_KEY, None)  # a new run never inherits its start model's context state
    _restore_context(scope, saved_context if continuing else None, rank, world, resume or out)
    with scope:
        bar = progress_bar(f"train {cfg.arch}", round(budget), enabled=progress, unit="s")
        step = step0
        while True:
            elapsed = time.monotonic() - t_start
            if _agreed(elapsed >= budget or (cfg.max_steps is not None and step - step0 >= cfg.max_steps), ddp):
                break
            if stop_at_step is not None and step >= stop_at_step:
                break
            pick = np.random.default_rng([cfg.seed, step, 11])
            shorter = length > cfg.start_length and pick.random() < cfg.shorter_share
            step_len = cfg.start_length * 2 ** int(pick.integers(math.log2(length // cfg.start_length))) if shorter else length
            ids, weights, row_tasks = make_batch(cfg, step_len, step * world + rank, tokenizer)
            for group in optimizer.param_groups:
                group["lr"] = _lr(cfg, step - warm0, elapsed)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
                logits = net(input_ids=ids, use_cache=False).logits  # (B, T, V)
            logits = logits.float()
            ce = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")
            loss = weighted_loss(ce, weights[:, 1:], cfg)
            if isinstance(scope, AuxiliaryLoss):  # e.g. a teacher pass: under the same autocast as the student
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
                    aux = scope.auxiliary_loss(model, ids, weights, logits)
                loss = loss + aux
                aux_losses.append(float(aux.detach()))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if not (bool(torch.isfinite(loss)) and bool(torch.isfinite(grad_norm))):
                raise TrainError(f"training diverged at step {step}: loss {loss.item()}, gradient norm {grad_norm.item()} "
                                 f"(lr {cfg.lr:g}); nothing of this run was saved as a model (periodic saves, if any, are "
                                 f"in {str(partial_dir(out))!r}) — lower --set lr=... and train again")
            optimizer.step()
            has, exact, first = answer_stats(logits.detach(), ids, weights, cfg.answer_weight)
            for r, task in enumerate(row_tasks):
                if has[r] and not shorter:
                    windows[task].append(float(exact[r]))
                    first_windows[task].append(float(first[r]))
            losses.append(loss.item())
            step += 1
            state["tokens"] += int(ids.numel()) * world
            now = time.monotonic()
            bar.set(round(now - t_start))
            em = {t: sum(w) / len(w) for t, w in windows.items() if w}
            ft = {t: sum(w) / len(w) for t, w in first_windows.items() if w}
            metric = ft if cfg.advance_metric == "first_token" else em
            gate = [metric.get(t, 0.0) for t in GATE_TASKS]
            full = all(len(windows[t]) >= cfg.window // 2 for t in GATE_TASKS)
            if (step - step0) % cfg.log_every == 0:
                point = {"step": step, "minutes": round((state["seconds"] + now - t_start) / 60, 2),
                         "tokens": state["tokens"], "length": length, "loss": round(float(np.mean(losses)), 4),
                         "exact": {t: round(v, 3) for t, v in em.items()},
                         "first_token": {t: round(v, 3) for t, v in ft.items()}}
                if aux_losses:
                    point["aux"] = round(float(np.mean(aux_losses)), 4)
                state["curve"].append(point)
                losses, aux_losses = [], []
                bar.note(f"len={length} loss={point['loss']} single={em.get('niah_single')} mk={em.get('niah_multikey')}")
                log(json.dumps(point))
            patience = now - stage_start > cfg.stage_patience_min * 60 and sum(gate) / len(gate) >= cfg.patience_floor
            if _agreed(length < cfg.max_length and full and (min(gate) >= cfg.advance_at or patience), ddp):
                state["stages"].append({"length": length, "step": step, "minutes": round((state["seconds"] + now - t_start) / 60, 2),
                                        "exact": {t: round(em.get(t, 0.0), 3) for t in GATE_TASKS},
                                        "first_token": {t: round(ft.get(t, 0.0), 3) for t in GATE_TASKS}})
                log(f"advance: length {length} -> {2 * length} at step {step} ({state['stages'][-1]})")
                length = min(2 * length, cfg.max_length)
                stage_start = now
                for w in (*windows.values(), *first_windows.values()):
                    w.clear()
            state["step"], state["length"] = step, length
            if _agreed(now - last_save > cfg.save_every_min * 60, ddp):
                extra = _context_states(scope, ddp, world)  # every rank's draws (a collective under DDP)
                if rank == 0:
                    save_run(model, tokenizer, optimizer, partial_dir(out),
                             {**state, "seconds": state["seconds"] + now - t_start, **extra})
                last_save = now
    bar.close()
    if stop_at_step is not None and step >= stop_at_step:
        extra = _context_states(scope, ddp, world)
        if rank == 0:
            save_run(model, tokenizer, optimizer, partial_dir(out),
                     {**state, "seconds": state["seconds"] + time.monotonic() - t_start, **extra})
        raise PartStopped(f"stopped at step {step} (--stop-at-step {stop_at_step}) as the recorded part was: its "
                          f"save is in {str(partial_dir(out))!r}; continue it with --resume")
    state["seconds"] += time.monotonic() - t_start
    state.update(_context_states(scope, ddp, world))
    model.eval()
    if rank == 0:
        save_run(model, tokenizer, optimizer, out, state)
        drop_partial(out)
    return state


class PartStopped(TrainError):
    """A part stopped at its ``stop_at_step`` with its periodic save written, as a part interrupted there did."""


def part_record(out: Path, resume: str | Path | None, step: int) -> dict[str, Any]:
    """What one training part was: its command line, output, start directory and first step."""
    argv = [Path(sys.argv[0]).name, *sys.argv[1:]] if sys.argv and sys.argv[0] else []
    return {"command": shlex.join(argv), "out": str(out), "resume": None if resume is None else str(resume),
            "from_step": step, "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}


def _agreed(flag: bool, ddp: bool) -> bool:
    """Rank 0's decision on every rank (a no-op without a process group)."""
    if not ddp:
        return flag
    t = torch.tensor([float(flag)])
    torch.distributed.broadcast(t, 0)
    return bool(t.item())


__all__ = ["ARCHS", "CONTEXT_KEY", "GATE_TASKS", "TASK_MIX", "AuxiliaryLoss", "PartStopped", "ResumableContext", "TrainConfig", "TrainError",
           "load_state", "make_batch", "model_config", "train"]
