"""Training the SEKV router on a frozen base model (``kvstate semantic train``).

From "SEKV: Resolution-Adaptive Semantic KV Cache with Hierarchical Semantic Memory": the base model
stays frozen; only the routing projections, zoom thresholds and rank-gate predictor train, with

- *distillation*: KL from the full-KV teacher's next-token distribution to the student's (question and
  answer positions), the student attending over the compressed context with soft zoom gates;
- *zoom supervision*: BCE of each span's zoom logit (max over the question / answer queries) against
  "this span holds >= ``mass`` of the teacher's attention for that head";
- *reconstruction*: relative error of the gated low-rank reconstruction of span K/V;
- *budget penalties*: the mean zoom gate (expansion), and the slow-tier bytes the rank gates keep beyond
  the slow-tier budget (``sum of gates x (n + D) / (n D)`` per span, above ``slow_budget``), so the
  predictor learns ranks that fit the budget the cache allocates under.

Examples come from the training seed stream of :mod:`kvstate.lab.workloads.tasks`, never the evaluation one.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from kvstate.errors import KVStateError
from kvstate.lab.workloads.tasks import TASKS, TRAIN_STREAM, TaskConfig, _make
from kvstate.models import model_fingerprint
from kvstate.semantic.attention import semantic_attention
from kvstate.semantic.cache import SemanticCache, SemanticConfig, surprisal
from kvstate.semantic.config import SLOW_BUDGET
from kvstate.semantic.lowrank import gated_reconstruction
from kvstate.semantic.router import RouterConfig, SemanticRouter
from kvstate.semantic.segment import SegmentConfig, span_weights
from kvstate.validate import check_float, check_int

CAPTURE = "sekv_capture"
MAX_MINUTES = 7 * 24 * 60.0  # a week: a longer budget is a typo, not a plan
ROW_ROOM = 64  # tokens a training row holds beyond its context: <bos>, the question, the answer, <eos>


@dataclass(frozen=True)
class TrainConfig:
    minutes: float = 10.0  # wall-clock budget
    max_steps: int | None = None  # stop earlier (tests)
    tasks: tuple[str, ...] = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "qa")
    lengths: tuple[int, ...] = (512, 1024)
    budget: float = 0.25  # fast-tier budget the router is trained at
    segment: SegmentConfig = field(default_factory=SegmentConfig)
    lr: float = 3e-3
    mass: float = 0.05  # zoom target: spans with at least this share of a head's attention
    pos_weight: float = 4.0  # a missed relevant span costs more than an extra expansion
    w_distill: float = 1.0
    w_zoom: float = 1.0
    w_rec: float = 1.0
    w_expand: float = 0.05
    w_rank: float = 0.02
    slow_budget: float = SLOW_BUDGET  # slow-tier bytes / raw span K/V the rank gates are trained under
    rec_spans: int = 8  # spans per layer per step for the reconstruction loss
    seed: int = 0

    def __post_init__(self) -> None:
        def f(name: str, v: object, *a: Any, **k: Any) -> None:
            check_float(f"TrainConfig.{name}", v, *a, error=KVStateError, **k)

        def i(name: str, v: object, *a: Any, **k: Any) -> None:
            check_int(f"TrainConfig.{name}", v, *a, error=KVStateError, **k)

        f("minutes", self.minutes, 0.0, MAX_MINUTES, lo_open=True)
        if self.max_steps is not None:
            i("max_steps", self.max_steps, 1, 10**9, hint=" or None (the --minutes budget alone)")
        f("budget", self.budget, 0.0, 1.0, lo_open=True)
        f("slow_budget", self.slow_budget, 0.0, 1.0, lo_open=True)
        f("mass", self.mass, 0.0, 1.0, lo_open=True, hi_open=True)
        for name in ("lr", "pos_weight"):
            f(name, getattr(self, name), 0.0, lo_open=True)
        for name in ("w_distill", "w_zoom", "w_rec", "w_expand", "w_rank"):
            f(name, getattr(self, name), 0.0)
        i("rec_spans", self.rec_spans, 1, 4096)
        i("seed", self.seed, 0, 2**31 - 1)
        if not isinstance(self.lengths, tuple) or not self.lengths or len(set(self.lengths)) != len(self.lengths):
            raise KVStateError(f"TrainConfig.lengths={self.lengths!r} must be a non-empty tuple without repeats")
        for length in self.lengths:
            i("lengths", length, 64, 2**20)
        if not isinstance(self.tasks, tuple) or not self.tasks or len(set(self.tasks)) != len(self.tasks) \
                or not all(t in TASKS and t != "text" for t in self.tasks):
            raise KVStateError(f"TrainConfig.tasks={self.tasks!r} must be a non-empty tuple of distinct task names "
                               f"(not 'text'), e.g. ('niah_single', 'qa')")
        if not isinstance(self.segment, SegmentConfig):
            raise KVStateError(f"TrainConfig.segment={self.segment!r} must be a SegmentConfig")

    def check_positions(self, config: Any) -> None:
        """Raise :class:`KVStateError` when a training row (context + question + answer) cannot fit the model's
        ``max_position_embeddings``."""
        from kvstate.models.families import text_config

        limit = getattr(text_config(config), "max_position_embeddings", None)
        if isinstance(limit, int) and max(self.lengths) + ROW_ROOM > limit:
            raise KVStateError(f"--length {max(self.lengths):,} + {ROW_ROOM} tokens for the question and answer "
                               f"exceeds the model's max_position_embeddings={limit:,}; pass lengths <= "
                               f"{limit - ROW_ROOM:,}")


@contextmanager
def capture(model: Any) -> Iterator[dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
    """Record each attention layer's (query, key, value) of a forward call, then run SDPA."""
    from transformers import AttentionInterface

    from kvstate.models.compat import attn_implementation, sdpa_attention_forward

    store: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def fn(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Any,
           **kw: Any) -> Any:
        store[module.layer_idx] = (query.detach(), key.detach(), value.detach())
        return sdpa_attention_forward(module, query, key, value, mask, **kw)

    AttentionInterface.register(CAPTURE, fn)
    old = attn_implementation(model.config)
    model.set_attn_implementation(CAPTURE)
    try:
        yield store
    finally:
        model.set_attn_implementation(old)


def _span_matrix(seg: Any, weights: list[np.ndarray], t: int) -> torch.Tensor:
    w = torch.zeros(len(seg.spans), t)
    for i, ((a, b), ws) in enumerate(zip(seg.spans, weights, strict=True)):
        w[i, a:b] = torch.as_tensor(ws, dtype=torch.float32)
    return w  # (S, T): row i holds span i's weights


def train_step(model: Any, router: SemanticRouter, tokenizer: Any, cfg: TrainConfig, step: int,
               opt: torch.optim.Optimizer) -> dict[str, float]:
    rng = np.random.default_rng([cfg.seed, step])
    task = cfg.tasks[int(rng.integers(len(cfg.tasks)))]
    length = cfg.lengths[int(rng.integers(len(cfg.lengths)))]
    ex = _make(task, length, TRAIN_STREAM, cfg.seed, step, tokenizer, TaskConfig(), None)
    ctx = tokenizer(ex.context)["input_ids"]
    rest = tokenizer(f"{ex.question} {ex.target}", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    ids = torch.tensor([ctx + rest])  # (1, T)
    tc, t = len(ctx), ids.shape[1]
    with torch.no_grad(), capture(model) as cap:
        logits = model(input_ids=ids, position_ids=torch.arange(t)[None]).logits.float()  # (1, T, V)
    teacher = logits[0, tc:]  # (Tr, V): next-token predictions at the question / answer positions
    s = surprisal(logits[:, :tc], ids[:, :tc])  # (Tc,)
    cache = SemanticCache(model, router, SemanticConfig(budget=cfg.budget, segment=cfg.segment, zoom="soft",
                                                        slow_budget=cfg.slow_budget, slow="lowrank",
                                                        expand_share=0.5))  # the router trains the low-rank tier
    for layer in cache.semantic_layers:  # fill the full-resolution context from the teacher pass
        _, k, v = cap[layer.layer_idx]
        layer.update(k[:, :, :tc], v[:, :, :tc])
    seg = cache.compress(s)
    weights = span_weights(s.numpy(), seg)
    wmat = _span_matrix(seg, weights, tc)  # (S, Tc)
    losses = {"zoom": torch.zeros(()), "expand": torch.zeros(()), "rec": torch.zeros(()), "rank": torch.zeros(())}
    member = (wmat > 0).float()  # (S, Tc)
    for layer in cache.semantic_layers:
        li = layer.layer_idx
        q, k, v = cap[li]
        kc = k[0, :, :tc]  # (H, Tc, D)
        route = nn.functional.normalize(torch.einsum("st,htr->hsr", wmat, kc @ router.k_proj[li]), dim=-1)  # (H, S, R)
        layer.store.route = route  # with grad: distillation reaches the key projection too
        qr = q[0, :, tc:]  # (Hq, Tr, D)
        g = qr.shape[0] // kc.shape[0]
        att = torch.softmax((qr @ k[0].repeat_interleave(g, 0).transpose(-1, -2)) * layer_scale(model, li)
                            + _causal(tc, t), -1)[..., :tc]  # (Hq, Tr, Tc)
        target = ((att @ member.T).amax(1) >= cfg.mass).float()  # (Hq, S)
        z = router.zoom_logits(li, qr, route).amax(1)  # (Hq, S)
        losses["zoom"] = losses["zoom"] + nn.functional.binary_cross_entropy_with_logits(
            z, target, pos_weight=torch.tensor(cfg.pos_weight))
        losses["expand"] = losses["expand"] + torch.sigmoid(z).mean()
        pick = rng.choice(len(seg.spans), size=min(cfg.rec_spans, len(seg.spans)), replace=False)
        for i in pick:
            a, b = (int(x) for x in seg.spans[i])
            for x, is_v in ((kc[:, a:b], False), (v[0, :, a:b], True)):
                rec, gates = gated_reconstruction(x, router.rank_gate, is_v)
                losses["rec"] = losses["rec"] + ((rec - x) ** 2).sum() / (x**2).sum().clamp_min(1e-12) / len(pick)
                n, d = x.shape[-2], x.shape[-1]
                kept = gates.mean(0).sum() * (n + d) / (n * d)  # gated slow-tier bytes / raw bytes of this span
                losses["rank"] = losses["rank"] + torch.relu(kept - cfg.slow_budget) / len(pick)
    with semantic_attention(model):
        student = model(input_ids=ids[:, tc:], position_ids=torch.arange(tc, t)[None], cache=cache).logits[0].float()
    distill = nn.functional.kl_div(torch.log_softmax(student, -1), torch.log_softmax(teacher, -1),
                                   log_target=True, reduction="batchmean")
    n_layers = len(cache.semantic_layers)
    total = (cfg.w_distill * distill + (cfg.w_zoom * losses["zoom"] + cfg.w_expand * losses["expand"]
             + cfg.w_rec * losses["rec"] + cfg.w_rank * losses["rank"]) / n_layers)
    opt.zero_grad()
    total.backward()
    nn.utils.clip_grad_norm_(router.parameters(), 1.0)
    opt.step()
    with torch.no_grad():
        answer_ok = float((student.argmax(-1) == teacher.argmax(-1)).float().mean())
    return {"loss": float(total.detach()), "distill": float(distill.detach()), **{k: float(v.detach()) / n_layers for k, v in losses.items()},
            "agree": answer_ok, "length": float(length)}


def layer_scale(model: Any, layer: int) -> float:
    tc = model.config.get_text_config(decoder=True)
    d = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
    return float(d) ** -0.5


def _causal(tc: int, t: int) -> torch.Tensor:
    rows = torch.arange(tc, t)[:, None]
    return torch.where(torch.arange(t)[None, :] > rows, float("-inf"), 0.0)  # (Tr, T)


def train_router(model: Any, tokenizer: Any, out_dir: Path, cfg: TrainConfig, progress: bool = True,
                 log: Any = None) -> dict[str, Any]:
    """Train a router for ``model`` (frozen) and save it to ``out_dir``; returns the manifest."""
    from kvstate.lab.progress import progress_bar

    cfg.check_positions(model.config)
    torch.manual_seed(cfg.seed)
    for p in model.parameters():
        p.requires_grad_(False)
    model.eval()
    router = SemanticRouter(RouterConfig.from_model_config(model.config), seed=cfg.seed)
    opt = torch.optim.Adam(router.parameters(), lr=cfg.lr)
    base = sum(p.numel() for p in model.parameters())
    trainable = router.n_parameters()
    history: list[dict[str, float]] = []
    t0 = time.perf_counter()
    step = 0
    bar = progress_bar("sekv train", cfg.max_steps, enabled=progress, unit="steps")
    window: list[dict[str, float]] = []
    while (time.perf_counter() - t0) / 60 < cfg.minutes and (cfg.max_steps is None or step < cfg.max_steps):
        stats = train_step(model, router, tokenizer, cfg, step, opt)
        window.append(stats)
        step += 1
        bar.advance()
        if step % 10 == 0 or (cfg.max_steps is not None and step == cfg.max_steps):
            row = {k: float(np.mean([w[k] for w in window])) for k in window[0]}
            row.update(step=step, minutes=round((time.perf_counter() - t0) / 60, 2))
            history.append(row)
            window = []
            bar.note(f"loss={row['loss']:.3f} agree={row['agree']:.2f}")
            if log is not None:
                log(json.dumps(row))
    bar.close()
    manifest = {
        "base_parameters": base, "trainable_parameters": trainable,
        "trainable_fraction": trainable / (base + trainable), "steps": step,
        "minutes": round((time.perf_counter() - t0) / 60, 2), "train_config": _jsonable(asdict(cfg)),
        "history": history,
    }
    router.save(out_dir, model_fingerprint(model), manifest)
    return manifest


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(d, default=lambda o: list(o) if isinstance(o, tuple) else str(o)))


