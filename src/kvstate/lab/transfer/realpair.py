"""The real cross-model pair: SmolLM2-135M-Instruct (producer) and a LoRA fine-tune of it (consumer), built here.

Semantic Cache Distillation and DroidSpeak ship a producer's state to a *different* consumer; on the real model
the consumer is the producer fine-tuned on a shifted domain and format, so its own K/V and residual stream drift
from the producer's. Technique of the fine-tune: LoRA (:mod:`kvstate.lab.transfer.lora`), merged into the weights.

The shift (:class:`FinetuneConfig`): the consumer reads the same RULER-shaped needle documents
(:mod:`kvstate.lab.workloads.realtext`, training items from a dev seed) but is trained to *answer in JSON*
(``{"answer": ["4729104"]}``) instead of the producer's sentence, and to model the haystack's legal prose itself
(a ``prompt_share`` of the loss is next-token loss on the prompt, and ``lm_share`` of the rows are plain
licence-text windows), at a learning rate high enough to move the K/V. Whether the producer's raw K/V still serve
it is the premise the pair exists for (:mod:`kvstate.lab.transfer.realpair_eval`), decided on a test seed.

A run is resumable: every ``save_every`` steps the factors (fp32), the AdamW state (safetensors) and the curve
go, whole, to ``<out>/.partial``; a rerun of the same command continues from there; the finished run writes
``<out>`` itself. :func:`export` writes the committed delta (bf16 factors + the run's record, a few MB) and
:func:`build` rebuilds the consumer's weights from the converted base and that delta (``make setup``). Run as a
module::

    OMP_NUM_THREADS=1 python -m kvstate.lab.transfer.realpair train --out runs/smollm2-ft --steps 150
    python -m kvstate.lab.transfer.realpair export --run runs/smollm2-ft --out models/smollm2-135m-ft-delta
    python -m kvstate.lab.transfer.realpair build   # models/smollm2-135m-ft from the base + the delta
    OMP_NUM_THREADS=1 python -m kvstate.lab.transfer.realpair calibrate   # the pair's SCD codec (make setup)
    OMP_NUM_THREADS=1 python -m kvstate.lab.transfer.realpair ridge       # its ridge maps, beside it (make setup)
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvstate.errors import KVStateError
from kvstate.lab.transfer import lora
from kvstate.lab.transfer.pair import BASE, CODEC, CONSUMER, DELTA
from kvstate.lab.transfer.real_prompts import CALIBRATION_SEED, calibration_prompts, json_reply

STATE = "training_state.json"
OPTIM = "optimizer.safetensors"


@dataclass(frozen=True)
class FinetuneConfig:
    steps: int = 150
    rows: int = 2  # rows per step (gradient accumulation, batch 1 each: no padding)
    length: int = 512  # tokens per row at most
    lr: float = 3e-3  # the pilot's choice (1e-3 left raw reuse serving the consumer)
    warmup: int = 10
    final_lr_share: float = 0.1  # cosine decay to this share of lr
    prompt_share: float = 0.3  # loss = (1 - s) * reply CE + s * prompt CE on task rows
    lm_share: float = 0.25  # share of rows that are plain licence-text windows (next-token loss on all)
    seed: int = 71  # the training items' seed: a dev seed (< 1000), never a test seed
    rank: int = 16
    alpha: float = 32.0
    save_every: int = 25

    def __post_init__(self) -> None:
        if not (self.steps >= 1 and self.rows >= 1 and 256 <= self.length <= 4096 and self.lr > 0
                and 0 <= self.prompt_share < 1 and 0 <= self.lm_share < 1 and 0 <= self.seed < 1000
                and self.save_every >= 1):
            raise KVStateError(f"fine-tune config {self}: need steps, rows, save_every >= 1, 256 <= length <= 4096, "
                               "lr > 0, shares in [0, 1) and a dev seed (< 1000)")

    @property
    def lora(self) -> lora.LoraConfig:
        return lora.LoraConfig(rank=self.rank, alpha=self.alpha)


def lr_at(cfg: FinetuneConfig, step: int) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (cfg.final_lr_share + (1 - cfg.final_lr_share) * 0.5 * (1 + math.cos(math.pi * t)))


def make_row(tok: Any, cfg: FinetuneConfig, step: int, k: int) -> tuple[list[int], list[int], str]:
    """Row ``k`` of step ``step`` (a pure function of the config, step and k): token ids, the index where the
    reply starts (``len(ids)`` for a text row: all of it is next-token loss) and its kind."""
    from kvstate.lab.workloads import realtext as rt

    rng = np.random.default_rng([cfg.seed, step, k])
    if rng.random() < cfg.lm_share:
        sentences = rt.haystack()
        start = int(rng.integers(0, len(sentences)))
        words: list[str] = []
        while len(words) < cfg.length:
            words += sentences[start % len(sentences)].split()
            start += 1
        ids = tok(" ".join(words))["input_ids"][:cfg.length]
        return [int(i) for i in ids], len(ids), "text"
    task = str(rng.choice(rt.TASKS))
    item = rt.make_item(tok, task, cfg.length - 48, cfg.seed, step * cfg.rows + k)
    reply = tok(json_reply(item.answers) + "<|im_end|>", add_special_tokens=False)["input_ids"]
    return list(item.prompt_ids) + [int(i) for i in reply], len(item.prompt_ids), task


def row_loss(model: Any, ids: list[int], reply_at: int, prompt_share: float) -> tuple[torch.Tensor, float, float]:
    x = torch.tensor([ids])
    logits = model(x).logits[0, :-1].float()
    ce = torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="none")
    prompt, reply = ce[: max(0, reply_at - 1)], ce[max(0, reply_at - 1):]
    if reply.numel() == 0:  # a text row
        loss = prompt.mean()
        return loss, float(loss.detach()), float("nan")
    loss = (1 - prompt_share) * reply.mean() + prompt_share * prompt.mean()
    return loss, float(prompt.detach().mean()), float(reply.detach().mean())


def _save(out: Path, adapters: Any, opt: Any, cfg: FinetuneConfig, state: dict[str, Any]) -> None:
    from kvstate.integrity import write_manifest
    from kvstate.io_safety import staged_dir
    from kvstate.lab.training.optim_io import save_optimizer

    with staged_dir(out) as tmp:
        lora.save_factors(tmp / lora.FACTORS, lora.factors(adapters), cfg.lora, {"step": state["step"]},
                          dtype=torch.float32)
        save_optimizer(opt, tmp / OPTIM)
        (tmp / STATE).write_text(json.dumps(state, indent=1))
        write_manifest(tmp)


def train(cfg: FinetuneConfig, out: Path, base: Path = BASE, say: Any = print) -> dict[str, Any]:
    """Fine-tune ``base`` with LoRA on the shifted mix; resumes from ``<out>/.partial`` (same config) if there."""
    from kvstate.lab.training.optim_io import load_optimizer
    from kvstate.models.loading import load_model, load_tokenizer

    if (out / STATE).is_file():
        raise KVStateError(f"{out} already holds a finished run; choose another --out or delete it")
    partial = out.parent / f".{out.name}.partial"
    model, tok = load_model(base, torch.float32), load_tokenizer(base)
    adapters = lora.attach(model, cfg.lora, seed=cfg.seed)
    opt = torch.optim.AdamW(list(lora.trainable(adapters)), lr=cfg.lr, weight_decay=0.0)
    state: dict[str, Any] = {"config": asdict(cfg), "base": str(base), "step": 0, "seconds": 0.0, "tokens": 0,
                             "curve": []}
    if (partial / STATE).is_file():
        saved = json.loads((partial / STATE).read_text())
        if saved.get("config") != asdict(cfg):
            raise KVStateError(f"{partial} holds a run of another config; delete it or rerun with its settings "
                               f"({saved.get('config')})")
        tensors, _, _ = lora.read_factors(partial / lora.FACTORS)
        lora.load_factors_into(adapters, tensors, partial)
        opt.load_state_dict(load_optimizer(partial / OPTIM))
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
            ids, reply_at, kind = make_row(tok, cfg, step, k)
            loss, p_ce, r_ce = row_loss(model, ids, reply_at, cfg.prompt_share)
            (loss / cfg.rows).backward()
            state["tokens"] += len(ids)
            window.append({"prompt_ce": p_ce, "reply_ce": r_ce, "kind_text": float(kind == "text")})
        torch.nn.utils.clip_grad_norm_(list(lora.trainable(adapters)), 1.0)
        opt.step()
        state["step"] = step + 1
        state["seconds"] = round(time.perf_counter() - t0, 1)
        if state["step"] % 5 == 0 or state["step"] == cfg.steps:
            rep = [w["reply_ce"] for w in window if not math.isnan(w["reply_ce"])]
            point = {"step": state["step"], "tokens": state["tokens"], "seconds": state["seconds"],
                     "lr": round(lr_at(cfg, step), 6),
                     "prompt_ce": round(float(np.mean([w["prompt_ce"] for w in window])), 4),
                     "reply_ce": round(float(np.mean(rep)), 4) if rep else None}
            state["curve"].append(point)
            window = []
            say(f"step {state['step']}/{cfg.steps}: prompt CE {point['prompt_ce']}, reply CE {point['reply_ce']}, "
                f"{state['tokens'] / max(1e-9, state['seconds']):.0f} tok/s")
        if state["step"] % cfg.save_every == 0 and state["step"] < cfg.steps:
            _save(partial, adapters, opt, cfg, state)
    _save(out, adapters, opt, cfg, state)
    shutil.rmtree(partial, ignore_errors=True)
    return state


def export(run: Path, dest: Path, overwrite: bool = False) -> None:
    """The committed delta: bf16 factors and the run's record (config, curve, tokens, seconds)."""
    from kvstate.integrity import write_manifest
    from kvstate.io_safety import staged_dir

    if dest.exists() and not overwrite:
        raise KVStateError(f"{dest} exists; pass --overwrite to replace it")
    tensors, cfg, _ = lora.read_factors(run / lora.FACTORS)
    state = json.loads((run / STATE).read_text())
    with staged_dir(dest) as tmp:
        lora.save_factors(tmp / lora.FACTORS, tensors, cfg, {"base": state["base"], "step": state["step"]})
        (tmp / STATE).write_text(json.dumps(state, indent=1))
        write_manifest(tmp)


def build(delta: Path = DELTA, base: Path = BASE, dest: Path = CONSUMER, overwrite: bool = True) -> int:
    """The consumer's weights: the converted base with the delta's factors merged in (float64), saved whole."""
    from kvstate.integrity import write_manifest
    from kvstate.io_safety import staged_dir
    from kvstate.models.loading import load_model, load_tokenizer

    if not (base / "config.json").is_file():
        raise KVStateError(f"{base} is missing: convert the base model first (make setup, or kvstate models convert)")
    if dest.exists() and not overwrite:
        raise KVStateError(f"{dest} exists; pass --overwrite to replace it")
    tensors, cfg, _ = lora.read_factors(delta / lora.FACTORS)
    model, tok = load_model(base, torch.float32), load_tokenizer(base)
    changed = lora.merge_into(model, tensors, cfg, delta)
    with staged_dir(dest) as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / "delta.json").write_text(json.dumps({"base": str(base), "delta": str(delta), "adapted": changed,
                                                    "lora": asdict(cfg)}, indent=1))
        write_manifest(tmp)
    return changed


def calibrate(producer: Path = BASE, consumer: Path = CONSUMER, out: Path = CODEC, prefixes: int = 24,
              length: int = 512, overwrite: bool = False, say: Any = print) -> Any:
    """The pair's SCD codec (REUSE maps, PATCH aligners; :func:`kvstate.transfer.calibrate.calibrate_on`) fitted on
    real-text prefixes (:func:`calibration_prompts`)."""
    from kvstate.io_safety import check_output_dir
    from kvstate.models.loading import load_model, load_tokenizer
    from kvstate.transfer.calibrate import CalibrationConfig, calibrate_on
    from kvstate.transfer.codec import MANIFEST, WEIGHTS, is_codec_dir

    check_output_dir(out, overwrite=overwrite, accept=is_codec_dir, kind=f"a codec directory ({WEIGHTS} + {MANIFEST})")
    cfg = CalibrationConfig(prefixes=prefixes, length=length, seed=CALIBRATION_SEED)
    p, tok = load_model(producer, torch.float32), load_tokenizer(producer)
    c = load_model(consumer, torch.float32)
    steps = [0]

    def tick(s: str) -> None:
        steps[0] += 1
        if steps[0] % 5 == 0:
            say(f"calibrate: {steps[0]} steps ({s})")

    codec = calibrate_on(p, c, calibration_prompts(tok, prefixes, length), cfg, progress=tick)
    codec.save(out)
    return codec


def ridge(codec_dir: Path = CODEC, producer: Path = BASE, consumer: Path = CONSUMER, say: Any = print) -> dict[str, str]:
    """The pair's ridge maps (``ridge_head`` / ``ridge_layer``, :mod:`kvstate.transfer.ridge`) fitted into the codec
    directory as the bench fits them (:func:`kvstate.lab.transfer.realpair_bench.ridge_artifacts`); maps already
    there are kept. One thread: the fit is then bit-identical on every machine, so results that read it stay
    current."""
    from kvstate.lab.transfer.realpair_bench import ridge_artifacts
    from kvstate.models.loading import load_model, load_tokenizer
    from kvstate.transfer.codec import is_codec_dir

    if not is_codec_dir(codec_dir):
        raise KVStateError(f"--codec {codec_dir}: not a codec directory; run `python -m kvstate.lab.transfer.realpair "
                           "calibrate` first")
    p, tok = load_model(producer, torch.float32), load_tokenizer(producer)
    c = load_model(consumer, torch.float32)
    return ridge_artifacts(p, c, tok, codec_dir, ["ridge_head", "ridge_layer"], say)


def card(delta: Path, premise: Path | None = None) -> str:
    """The consumer's card (``<delta>/README.md``): what it was trained on, how, its curve, and, from a premise
    result (:mod:`kvstate.lab.transfer.realpair_eval`), its scores beside the producer's and its per-layer drift."""
    state = json.loads((delta / STATE).read_text())
    cfg = FinetuneConfig(**state["config"])
    lines = [
        f"# {CONSUMER.name} — the real pair's consumer: SmolLM2-135M-Instruct fine-tuned with LoRA on a shifted format",
        "",
        f"The decode side of the real cross-model pair (producer `{BASE}`). Generated by "
        "`python -m kvstate.lab.transfer.realpair card` from this directory's `training_state.json` and the premise "
        "run; the module docstrings of `kvstate.lab.transfer.realpair` / `realpair_eval` say what is measured.",
        "",
        "## What is committed and how the model is built",
        "",
        f"`{lora.FACTORS}` holds the LoRA factors (rank {cfg.rank}, alpha {cfg.alpha:g}, on "
        f"{', '.join(lora.TARGETS)} of every layer; bf16, {(delta / lora.FACTORS).stat().st_size / 1e6:.1f} MB). "
        f"`make setup` merges them into the converted base (float64, then fp32) and writes `{CONSUMER}` (gitignored): "
        "`python -m kvstate.lab.transfer.realpair build`.",
        "",
        "## Training",
        "",
        f"{state['step']} steps x {cfg.rows} rows of at most {cfg.length} tokens ({state['tokens']:,} tokens, "
        f"{state['seconds'] / 60:.1f} min on 1 CPU thread), AdamW lr {cfg.lr:g} ({cfg.warmup}-step warm-up, cosine "
        f"to {cfg.final_lr_share:g}x), gradient clip 1.0. Data (seed {cfg.seed}, a dev seed): {1 - cfg.lm_share:.0%} "
        "of rows are the real-text needle tasks (`kvstate.lab.workloads.realtext`, every task, the producer's "
        "chat prompt) answered in JSON (`{\"answer\": [\"4729104\"]}`, the producer answers in a sentence); "
        f"{cfg.lm_share:.0%} are windows of the haystack's licence prose (next-token loss on all of it). Task rows: "
        f"loss = {1 - cfg.prompt_share:g} x reply CE + {cfg.prompt_share:g} x prompt CE. This run cannot be replayed "
        "by `kvstate lab retrain` (which replays `kvstate train` runs); the command below replays it (one part, "
        "resumable, deterministic rows; the weights match to the CPU's float rounding):",
        "",
        "```",
        "OMP_NUM_THREADS=1 python -m kvstate.lab.transfer.realpair train --out runs/smollm2-ft" + "".join(
            f" --{k.replace('_', '-')} {v}" for k, v in state["config"].items()
            if v != FinetuneConfig.__dataclass_fields__[k].default),
        f"python -m kvstate.lab.transfer.realpair export --run runs/smollm2-ft --out {DELTA}",
        "```",
        "",
        "| step | tokens | minutes | lr | prompt CE | reply CE |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    curve = state["curve"]
    shown = curve[:: max(1, len(curve) // 10)]
    if curve and shown[-1] is not curve[-1]:
        shown.append(curve[-1])
    for pt in shown:
        lines.append(f"| {pt['step']} | {pt['tokens']:,} | {pt['seconds'] / 60:.1f} | {pt['lr']:g} | {pt['prompt_ce']} | "
                     f"{pt['reply_ce']} |")
    if premise is not None and premise.is_file():
        doc = json.loads(premise.read_text())
        run = doc["runs"][-1]
        lines += ["", f"## Against the producer (`{premise}`, seed {run['rows'][0]['seed']}, the newest run)", "",
                  "| method | task | length | n | score [95% CI] |", "|---|---|---:|---:|---|"]
        for r in run["rows"]:
            lines.append(f"| {r['method']} | {r['task']} | {r['length']} | {r['n']} | {r['value']:.3f} "
                         f"[{r['ci'][0]:.3f}, {r['ci'][1]:.3f}] |")
        for d in run["decisions"]:
            lines.append(f"\nTarget: {d['label']}: **{d['status']}** ({d['value']:+.3f} [{d['ci'][0]:+.3f}, "
                         f"{d['ci'][1]:+.3f}], n = {d['n']}).")
        dr = (run.get("appendix") or {}).get("drift") or {}
        if dr:
            lines += ["", "Drift: per layer, the mean cosine between the producer's and the consumer's cached K (after "
                      f"RoPE) and V over positions and KV heads ({dr['items']} items):", "",
                      "| layer | " + " | ".join(str(i) for i in range(len(dr["drift_k"]))) + " |",
                      "|---|" + "---:|" * len(dr["drift_k"]),
                      "| K | " + " | ".join(f"{x:.3f}" for x in dr["drift_k"]) + " |",
                      "| V | " + " | ".join(f"{x:.3f}" for x in dr["drift_v"]) + " |"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvstate.lab.transfer.realpair", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train")
    t.add_argument("--out", type=Path, required=True)
    t.add_argument("--base", type=Path, default=BASE)
    for f in FinetuneConfig.__dataclass_fields__.values():
        t.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    e = sub.add_parser("export")
    e.add_argument("--run", type=Path, required=True)
    e.add_argument("--out", type=Path, default=DELTA)
    e.add_argument("--overwrite", action="store_true")
    b = sub.add_parser("build")
    b.add_argument("--delta", type=Path, default=DELTA)
    b.add_argument("--base", type=Path, default=BASE)
    b.add_argument("--out", type=Path, default=CONSUMER)
    c = sub.add_parser("calibrate")
    c.add_argument("--out", type=Path, default=CODEC)
    c.add_argument("--prefixes", type=int, default=24)
    c.add_argument("--length", type=int, default=512)
    c.add_argument("--overwrite", action="store_true")
    r = sub.add_parser("ridge", help="fit the ridge maps (per head, per layer) into the codec directory")
    r.add_argument("--codec", type=Path, default=CODEC)
    k = sub.add_parser("card")
    k.add_argument("--delta", type=Path, default=DELTA)
    k.add_argument("--premise", type=Path, default=None)
    args = ap.parse_args(argv)
    try:
        if args.cmd == "train":
            torch.set_num_threads(1)
            cfg = FinetuneConfig(**{k: getattr(args, k) for k in FinetuneConfig.__dataclass_fields__})
            train(cfg, args.out, args.base, say=lambda m: print(f"realpair: {m}", file=sys.stderr, flush=True))
        elif args.cmd == "export":
            export(args.run, args.out, args.overwrite)
        elif args.cmd == "calibrate":
            torch.set_num_threads(1)
            codec = calibrate(out=args.out, prefixes=args.prefixes, length=args.length, overwrite=args.overwrite,
                              say=lambda m: print(f"realpair: {m}", file=sys.stderr, flush=True))
            print(f"realpair: codec {args.out}: patch layers {list(codec.config.patch_layers)}; next-token KL vs the "
                  f"consumer {codec.info.get('kl_all_layers')}", file=sys.stderr)
        elif args.cmd == "ridge":
            torch.set_num_threads(1)
            ridge(args.codec, say=lambda m: print(f"realpair: {m}", file=sys.stderr, flush=True))
        elif args.cmd == "card":
            from kvstate.io_safety import write_text_atomic

            write_text_atomic(args.delta / "README.md", card(args.delta, args.premise))
        else:
            n = build(args.delta, args.base, args.out)
            print(f"realpair: built {args.out} ({n} weights adapted from {args.delta})", file=sys.stderr)
    except KVStateError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
