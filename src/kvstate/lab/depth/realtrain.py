"""R-CLA fine-tuning of the real model: SmolLM2-135M-Instruct taught to answer under cross-layer KV sharing.

Technique: Random Cross-Layer Attention ("Stochastic KV Routing", :mod:`kvstate.depth.routing`) — at every
training forward each attention layer keeps its own K/V with probability ``p`` and otherwise reads an earlier
layer's, so one model serves any sharing pattern of its family at deployment; against it, a specialist trained
on one fixed pattern (CLA2, "Reducing Transformer Key-Value Cache Size with Cross-Layer Attention", Brandon et
al. 2024). Post hoc, SmolLM2 collapses at keep 0.5 (every family 0.00 on its needle tasks,
``docs/results/smollm2_depth_posthoc_pilot.json``); this module asks how much a fine-tune that fits a 2-core
machine recovers.

What fits (:class:`DepthFinetuneConfig`): LoRA adapters on every linear map of the decoder
(:mod:`kvstate.lab.transfer.lora`, merged into the weights afterwards), rows of ``length`` tokens, batch 1 with
``rows`` accumulated per step. The objective is self-distillation from the **unmodified** model (the adapters
switched off, every layer on its own K/V, no gradient — SwiftKV's knowledge-preserving signal, as
:mod:`kvstate.depth.distill` does for the reference models): the KL from its next-token distribution to the
routed student's at every position, the reply's positions weighted ``reply_share`` of the whole, plus
cross-entropy on the reply. Rows are the real-text needle tasks from a dev seed with the model's own reply
format (``The special magic number for <key> is <number>.``) and ``lm_share`` plain licence-text windows. The
teacher being the base model keeps the keep-1 behaviour where it was; the routed student learns to retrieve
through shared K/V.

A run is resumable like :mod:`kvstate.lab.transfer.realpair`'s: every ``save_every`` steps the factors, the
optimizer, the routing's draw state and the curve go, whole, to ``.<out>.partial``; the same command continues
from there (another config is refused, naming the setting). :func:`build` merges the factors into a model
directory the depth evaluation loads (``python -m kvstate.lab.depth.realmodel --model <dir>``). Run as a module::

    OMP_NUM_THREADS=1 python -m kvstate.lab.depth.realtrain train --pattern rcla --steps 90 --out runs/rcla-pilot
    python -m kvstate.lab.depth.realtrain build --run runs/rcla-pilot --out runs/rcla-pilot-model
    python -m kvstate.lab.depth.realtrain export --run runs/rcla-pilot --out models/smollm2-135m-rcla-delta

``export`` writes the bf16 factors and the run's record (a few MB, committed); ``build --run`` takes that delta
directory as well as a run.

Ignored: full fine-tuning (LoRA only), bf16 autocast, lengths beyond ``length`` (the evaluation runs at 1K).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvstate.errors import KVStateError
from kvstate.lab.transfer import lora

STATE = "training_state.json"
OPTIM = "optimizer.safetensors"
# stochastic routing (R-CLA); the fixed CLA2 pattern at every step (the specialist); or a uniform draw per row from the
# declared keep-0.5 family the evaluation scores (kvstate.lab.depth.rcla_eval.family: keep = CLA2, top_shared and
# FAMILY_NEAREST nearest-owner draws) — R-CLA whose routing distribution is the declared family
PATTERNS = ("rcla", "cla2", "family")
FAMILY_NEAREST = 2
TASKS = ("niah_single", "niah_multikey")  # the depth evaluation's tasks (kvstate.lab.depth.realmodel.TASKS)
_KEY = re.compile(r"magic number for (\S+?)\?")
NEAREST = "nearest"  # R-CLA over the nearest-owner family (kvstate.lab.depth.nearest): any owner set, read the closest


@dataclass(frozen=True)
class DepthFinetuneConfig:
    pattern: str = "rcla"  # one of PATTERNS
    p: float = 0.5  # R-CLA: the probability that a layer keeps its own K/V
    rule: str = "owner"  # R-CLA's draw: a registered rule (kvstate.depth.registry.RULES) or NEAREST
    anneal: float = 0.0  # R-CLA: p goes from 1 to ``p`` over this share of the run's draws (LayerSkip's curriculum)
    steps: int = 90
    rows: int = 2  # rows per step (gradient accumulation, batch 1 each: no padding)
    length: int = 512  # tokens per row at most
    lr: float = 2e-3
    warmup: int = 10
    final_lr_share: float = 0.1  # cosine decay to this share of lr
    reply_share: float = 0.5  # the reply's share of a task row's KL; the prompt's is the rest
    ce_weight: float = 1.0  # weight of the reply's cross-entropy beside the KL
    lm_share: float = 0.2  # share of rows that are plain licence-text windows (KL on every position)
    seed: int = 81  # the training items' and the draws' seed: a dev seed (< 1000), never a test seed
    rank: int = 16
    alpha: float = 32.0
    save_every: int = 10

    def __post_init__(self) -> None:
        if self.pattern not in PATTERNS:
            raise KVStateError(f"pattern {self.pattern!r}: choose one of {', '.join(PATTERNS)}")
        if self.pattern == "family" and self.anneal:
            raise KVStateError(f"anneal={self.anneal}: the family draw has no p to anneal; drop --anneal")
        if not (0 < self.p < 1 and self.steps >= 1 and self.rows >= 1 and 256 <= self.length <= 4096
                and self.lr > 0 and 0 < self.reply_share < 1 and self.ce_weight >= 0 and 0 <= self.lm_share < 1
                and 0 <= self.seed < 1000 and self.save_every >= 1 and 0 <= self.anneal < 1):
            raise KVStateError(f"depth fine-tune config {self}: need 0 < p < 1, steps, rows, save_every >= 1, "
                               "256 <= length <= 4096, lr > 0, shares and anneal in (0, 1) / [0, 1), ce_weight >= 0 "
                               "and a dev seed (< 1000)")
        if self.rule != NEAREST:
            from kvstate.depth.registry import RULES

            RULES.get(self.rule)  # refuses an unknown rule, listing the registry's
        if self.pattern != "rcla" and self.anneal:
            raise KVStateError(f"anneal={self.anneal}: a fixed pattern has no p to anneal; drop --anneal or train rcla")

    @property
    def lora(self) -> lora.LoraConfig:
        return lora.LoraConfig(rank=self.rank, alpha=self.alpha)


def lr_at(cfg: DepthFinetuneConfig, step: int) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (cfg.final_lr_share + (1 - cfg.final_lr_share) * 0.5 * (1 + math.cos(math.pi * t)))


def own_reply(tok: Any, prompt_ids: list[int], answers: tuple[str, ...]) -> str:
    """The model's own answer format for a single-answer needle item (what SmolLM2 replies with its full cache)."""
    m = _KEY.search(tok.decode(prompt_ids[-48:]))
    key = m.group(1) if m else "it"
    return f"The special magic number for {key} is {answers[0]}."


def make_row(tok: Any, cfg: DepthFinetuneConfig, step: int, k: int) -> tuple[list[int], int, str]:
    """Row ``k`` of step ``step`` (a pure function of the config, step and k): token ids, the index where the
    reply starts (``len(ids)`` for a text row) and its kind."""
    from kvstate.lab.workloads import realtext as rt

    rng = np.random.default_rng([cfg.seed, step, k, 7])
    if rng.random() < cfg.lm_share:
        sentences = rt.haystack()
        start = int(rng.integers(0, len(sentences)))
        words: list[str] = []
        while len(words) < cfg.length:
            words += sentences[start % len(sentences)].split()
            start += 1
        ids = tok(" ".join(words))["input_ids"][:cfg.length]
        return [int(i) for i in ids], len(ids), "text"
    task = str(rng.choice(TASKS))
    item = rt.make_item(tok, task, cfg.length - 32, cfg.seed, step * cfg.rows + k)
    prompt = list(item.prompt_ids)
    reply = tok(own_reply(tok, prompt, item.answers) + "<|im_end|>", add_special_tokens=False)["input_ids"]
    return prompt + [int(i) for i in reply], len(prompt), task


@contextmanager
def adapters_off(adapters: Any) -> Iterator[None]:
    """The unmodified model: every adapter's scale at 0 inside the block."""
    saved = {n: m.scale for n, m in adapters.items()}
    try:
        for m in adapters.values():
            m.scale = 0.0
        yield
    finally:
        for n, m in adapters.items():
            m.scale = saved[n]


def row_loss(student: torch.Tensor, teacher: torch.Tensor, ids: list[int], reply_at: int,
             cfg: DepthFinetuneConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """The step's loss on one row from the student's and the teacher's logits (T, V): the weighted KL plus the
    reply's cross-entropy; and its parts for the curve."""
    log_s = torch.log_softmax(student[:-1].float(), -1)
    log_t = torch.log_softmax(teacher[:-1].float(), -1)
    kl = (log_t.exp() * (log_t - log_s)).sum(-1)  # (T - 1,): position t predicts token t + 1
    cut = max(0, reply_at - 1)
    prompt_kl, reply_kl = kl[:cut], kl[cut:]
    if reply_kl.numel() == 0:  # a text row
        loss = prompt_kl.mean()
        return loss, {"prompt_kl": float(loss.detach()), "reply_kl": float("nan"), "reply_ce": float("nan")}
    target = torch.tensor(ids[1:])[cut:]
    ce = torch.nn.functional.nll_loss(log_s[cut:], target)
    loss = (1 - cfg.reply_share) * prompt_kl.mean() + cfg.reply_share * (reply_kl.mean() + cfg.ce_weight * ce)
    return loss, {"prompt_kl": float(prompt_kl.detach().mean()), "reply_kl": float(reply_kl.detach().mean()),
                  "reply_ce": float(ce.detach())}


class _Routing:
    """The student's sharing: a fresh R-CLA draw per forward, or the fixed CLA2 pattern."""

    def __init__(self, model: Any, cfg: DepthFinetuneConfig) -> None:
        from kvstate.depth.attention import layer_specs
        from kvstate.depth.registry import FAMILIES
        from kvstate.depth.routing import StochasticKVRouting

        self.model, self.cfg = model, cfg
        self.layers = layer_specs(model.config)
        anneal = round(cfg.anneal * cfg.steps * cfg.rows)
        self.nearest = _NearestDraws(self.layers, cfg.p, cfg.seed, anneal) if (
            cfg.pattern == "rcla" and cfg.rule == NEAREST) else None
        self.routing = (StochasticKVRouting(model, cfg.p, seed=cfg.seed, rule=cfg.rule, anneal_steps=anneal)
                        if cfg.pattern == "rcla" and self.nearest is None else None)
        self.fixed = FAMILIES.get("cla").build(self.layers, 2) if cfg.pattern == "cla2" else None
        self.family = _FamilyDraws(self.layers, cfg.seed) if cfg.pattern == "family" else None

    @contextmanager
    def student(self) -> Iterator[None]:
        from kvstate.depth.attention import routed

        if self.routing is not None:
            with self.routing:
                yield
        elif self.nearest is not None or self.family is not None:
            with routed(self.model, self.nearest or self.family):
                yield
        else:
            fixed = self.fixed
            with routed(self.model, lambda: fixed):
                yield

    def state_dict(self) -> dict[str, Any] | None:
        for draws in (self.nearest, self.family):
            if draws is not None:
                return draws.state_dict()
        return None if self.routing is None else self.routing.state_dict()

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if state is None:
            return
        if self.nearest is not None or self.family is not None:
            (self.nearest or self.family).load_state_dict(state)
        elif self.routing is not None:
            self.routing.load_state_dict(state)

    def owners(self) -> float:
        if self.fixed is not None:
            return float(len(self.fixed.owners))
        draws = (self.nearest or self.family or self.routing).draws
        last = draws[-self.cfg.rows:]
        return float(np.mean([len(d.owners) for d in last])) if last else float("nan")


class _NearestDraws:
    """A fresh nearest-owner pattern per forward pass (p annealed from 1 over ``anneal`` draws), resumable."""

    def __init__(self, layers: Any, p: float, seed: int, anneal: int) -> None:
        import random

        self.layers, self.p, self.anneal = layers, p, anneal
        self.rng = random.Random(seed)
        self.drawn = 0
        self.draws: list[Any] = []

    def __call__(self) -> Any:
        from kvstate.lab.depth import nearest

        p = 1 - (1 - self.p) * min(1.0, self.drawn / self.anneal) if self.anneal else self.p
        pattern = nearest.draw(self.layers, p, self.rng)
        self.drawn += 1
        self.draws = [*self.draws[-63:], pattern]
        return pattern

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = self.rng.getstate()
        return {"rule": NEAREST, "draws": self.drawn, "rng": [version, list(internal), gauss]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        version, internal, gauss = state["rng"]
        self.rng.setstate((int(version), tuple(int(x) for x in internal), gauss))
        self.drawn = int(state["draws"])


class _FamilyDraws(_NearestDraws):
    """A uniform draw per forward pass from the declared keep-0.5 family, resumable."""

    def __init__(self, layers: Any, seed: int) -> None:
        from kvstate.lab.depth.rcla_eval import family

        super().__init__(layers, 0.5, seed, 0)
        self.patterns = [r.pattern for r in family(layers, draws=0, draw_seed=0, nearest=FAMILY_NEAREST)]

    def __call__(self) -> Any:
        pattern = self.patterns[self.rng.randrange(len(self.patterns))]
        self.drawn += 1
        self.draws = [*self.draws[-63:], pattern]
        return pattern

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "rule": "family"}


def _save(out: Path, adapters: Any, opt: Any, cfg: DepthFinetuneConfig, state: dict[str, Any]) -> None:
    from kvstate.integrity import write_manifest
    from kvstate.io_safety import staged_dir
    from kvstate.lab.training.optim_io import save_optimizer

    with staged_dir(out) as tmp:
        lora.save_factors(tmp / lora.FACTORS, lora.factors(adapters), cfg.lora, {"step": state["step"]},
                          dtype=torch.float32)
        save_optimizer(opt, tmp / OPTIM)
        (tmp / STATE).write_text(json.dumps(state, indent=1))
        write_manifest(tmp)


def _mean(window: list[dict[str, float]], key: str) -> float | None:
    vals = [w[key] for w in window if not math.isnan(w[key])]
    return round(float(np.mean(vals)), 4) if vals else None


def _differing(saved: dict[str, Any], cfg: DepthFinetuneConfig) -> str:
    mine = asdict(cfg)
    diff = [f"{k}={saved.get(k)!r} (this run: {v!r})" for k, v in mine.items() if saved.get(k) != v]
    return "; ".join(diff) or "the config's keys"


def train(cfg: DepthFinetuneConfig, out: Path, base: Path, say: Any = print) -> dict[str, Any]:
    """Fine-tune ``base`` with LoRA under ``cfg.pattern``; resumes from ``.<out>.partial`` (same config) if there."""
    from kvstate.lab.training.optim_io import load_optimizer
    from kvstate.models.loading import load_model, load_tokenizer

    if (out / STATE).is_file():
        raise KVStateError(f"{out} already holds a finished run; choose another --out or delete it")
    partial = out.parent / f".{out.name}.partial"
    saved = json.loads((partial / STATE).read_text()) if (partial / STATE).is_file() else None
    if saved is not None and saved.get("config") != asdict(cfg):  # refused before the weights load
        raise KVStateError(f"{partial} holds a run of another config ({_differing(saved.get('config') or {}, cfg)}); "
                           "rerun with its settings or delete it")
    model, tok = load_model(base, torch.float32), load_tokenizer(base)
    adapters = lora.attach(model, cfg.lora, seed=cfg.seed)
    opt = torch.optim.AdamW(list(lora.trainable(adapters)), lr=cfg.lr, weight_decay=0.0)
    sharing = _Routing(model, cfg)
    state: dict[str, Any] = {"config": asdict(cfg), "base": str(base), "step": 0, "seconds": 0.0, "tokens": 0,
                             "curve": [], "routing": None}
    if saved is not None:
        tensors, _, _ = lora.read_factors(partial / lora.FACTORS)
        lora.load_factors_into(adapters, tensors, partial)
        opt.load_state_dict(load_optimizer(partial / OPTIM))
        sharing.load_state_dict(saved.get("routing"))
        state = saved
        say(f"resumed at step {state['step']} from {partial}")
    model.train()
    t0 = time.perf_counter() - float(state["seconds"])
    window: list[dict[str, float]] = []
    while state["step"] < cfg.steps:
        step = int(state["step"])
        for g in opt.param_groups:
            g["lr"] = lr_at(cfg, step)
        opt.zero_grad(set_to_none=True)
        for k in range(cfg.rows):
            ids, reply_at, _kind = make_row(tok, cfg, step, k)
            x = torch.tensor([ids])
            with torch.no_grad(), adapters_off(adapters):
                teacher = model(x, use_cache=False).logits[0]
            with sharing.student():
                student = model(x, use_cache=False).logits[0]
            loss, parts = row_loss(student, teacher, ids, reply_at, cfg)
            (loss / cfg.rows).backward()
            state["tokens"] += len(ids)
            window.append(parts)
        torch.nn.utils.clip_grad_norm_(list(lora.trainable(adapters)), 1.0)
        opt.step()
        state["step"] = step + 1
        state["seconds"] = round(time.perf_counter() - t0, 1)
        state["routing"] = sharing.state_dict()
        if state["step"] % 5 == 0 or state["step"] == cfg.steps:
            point = {"step": state["step"], "tokens": state["tokens"], "seconds": state["seconds"],
                     "lr": round(lr_at(cfg, step), 6), **{k: _mean(window, k) for k in ("prompt_kl", "reply_kl",
                                                                                         "reply_ce")},
                     "owners": sharing.owners()}
            state["curve"].append(point)
            window = []
            say(f"step {state['step']}/{cfg.steps}: prompt KL {point['prompt_kl']}, reply KL {point['reply_kl']}, "
                f"reply CE {point['reply_ce']}, {state['tokens'] / max(1e-9, state['seconds']):.0f} tok/s")
        if state["step"] % cfg.save_every == 0 and state["step"] < cfg.steps:
            _save(partial, adapters, opt, cfg, state)
    _save(out, adapters, opt, cfg, state)
    shutil.rmtree(partial, ignore_errors=True)
    return state


def build(run: Path, base: Path, dest: Path, overwrite: bool = False) -> int:
    """A model directory: ``base`` with the run's factors merged in (float64), saved whole, with the run's record."""
    from kvstate.integrity import write_manifest
    from kvstate.io_safety import staged_dir
    from kvstate.models.loading import load_model, load_tokenizer

    if not (run / STATE).is_file():
        raise KVStateError(f"{run} holds no finished depth fine-tune ({STATE} missing); finish or resume it first")
    if dest.exists() and not overwrite:
        raise KVStateError(f"{dest} exists; pass --overwrite to replace it")
    tensors, cfg, _ = lora.read_factors(run / lora.FACTORS)
    model, tok = load_model(base, torch.float32), load_tokenizer(base)
    changed = lora.merge_into(model, tensors, cfg, run)
    state = json.loads((run / STATE).read_text())
    with staged_dir(dest) as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / "finetune.json").write_text(json.dumps({"base": str(base), "run": str(run), "adapted": changed,
                                                       "lora": asdict(cfg), "config": state["config"],
                                                       "tokens": state["tokens"], "seconds": state["seconds"]},
                                                      indent=1))
        write_manifest(tmp)
    return changed


CURVES_FORMAT = "kvstate-finetune-curves/1"


def curves(runs: dict[str, Path], out: Path, overwrite: bool = False) -> dict[str, Any]:
    """The finished runs' records (config, curve, tokens, seconds) in one JSON file: what a report plots."""
    from kvstate.io_safety import write_bytes_atomic

    if out.exists() and not overwrite:
        raise KVStateError(f"{out} exists; pass --overwrite to replace it")
    doc: dict[str, Any] = {"format": CURVES_FORMAT, "runs": {}}
    for name, run in runs.items():
        if not (run / STATE).is_file():
            raise KVStateError(f"{run} holds no finished depth fine-tune ({STATE} missing); finish or resume it first")
        state = json.loads((run / STATE).read_text())
        doc["runs"][name] = {k: state[k] for k in ("config", "base", "step", "tokens", "seconds", "curve")}
    write_bytes_atomic(out, (json.dumps(doc, indent=1) + "\n").encode())
    return doc


def main(argv: list[str] | None = None) -> int:
    from kvstate.lab.models.cli import REAL_MODEL

    ap = argparse.ArgumentParser(prog="python -m kvstate.lab.depth.realtrain", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="LoRA fine-tune under R-CLA routing or the fixed CLA2 pattern (resumable)")
    defaults = DepthFinetuneConfig()
    for f in ("pattern", "p", "rule", "anneal", "steps", "rows", "length", "lr", "reply_share", "ce_weight", "lm_share", "seed",
              "rank", "save_every"):
        t.add_argument("--" + f.replace("_", "-"), type=type(getattr(defaults, f)), default=getattr(defaults, f))
    t.add_argument("--base", type=Path, default=REAL_MODEL)
    t.add_argument("--out", type=Path, required=True)
    b = sub.add_parser("build", help="merge a finished run's factors into a model directory")
    b.add_argument("--run", type=Path, required=True)
    b.add_argument("--base", type=Path, default=REAL_MODEL)
    b.add_argument("--out", type=Path, required=True)
    b.add_argument("--overwrite", action="store_true")
    x = sub.add_parser("export", help="a finished run's factors in bf16 with its record: the committed delta")
    x.add_argument("--run", type=Path, required=True)
    x.add_argument("--out", type=Path, required=True)
    x.add_argument("--overwrite", action="store_true")
    c = sub.add_parser("curves", help="write finished runs' curves to one JSON file (the report plots it)")
    c.add_argument("--run", action="append", default=[], help="NAME=DIR of a finished run (repeatable)")
    c.add_argument("--out", type=Path, required=True)
    c.add_argument("--overwrite", action="store_true")
    a = ap.parse_args(argv)

    def say(m: str) -> None:
        print(f"depth-finetune: {m}", file=sys.stderr, flush=True)

    try:
        if a.cmd == "train":
            torch.set_num_threads(1)
            cfg = DepthFinetuneConfig(**{f: getattr(a, f) for f in (
                "pattern", "p", "rule", "anneal", "steps", "rows", "length", "lr", "reply_share", "ce_weight", "lm_share", "seed",
                "rank", "save_every")})
            state = train(cfg, a.out, a.base, say)
            say(f"done: {state['tokens']} tokens in {state['seconds']} s -> {a.out}")
        elif a.cmd == "export":
            from kvstate.lab.transfer.realpair import export

            if not (a.run / STATE).is_file():
                raise KVStateError(f"{a.run} holds no finished depth fine-tune ({STATE} missing); finish it first")
            export(a.run, a.out, a.overwrite)
            say(f"wrote {a.out} (bf16 factors; rebuild the model with: build --run {a.out} --out DIR)")
        elif a.cmd == "curves":
            pairs = [r.partition("=") for r in a.run]
            if not pairs or any(not n or not eq or not d for n, eq, d in pairs):
                raise KVStateError(f"--run {a.run}: give NAME=DIR at least once, e.g. rcla=runs/depth/pilot-rcla")
            curves({n: Path(d) for n, _, d in pairs}, a.out, a.overwrite)
            say(f"wrote {a.out}")
        else:
            n = build(a.run, a.base, a.out, a.overwrite)
            say(f"built {a.out} ({n} weights adapted)")
    except KVStateError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
