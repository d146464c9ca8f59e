"""Offline calibration of an SCD codec on paired prefixes: REUSE maps, PATCH aligners, transition layers.

*Semantic Cache Distillation: Efficient State Transfer via Reuse and Selective Patching*
(``docs/techniques.md#across-models``). Every calibration prefix runs through both models; per layer
and KV head a joint low-rank decomposition of producer and consumer keys (pre-rotary) and values
(:func:`kvstate.transfer.lowrank.fit_joint`, separate ranks: the producer's principal code, decoded
by a scaled orthogonal map into the consumer's space) gives the REUSE encoder / decoder; per
layer a reduced-rank regression of the normalised pre-attention input ``H_in`` (``patch_map="joint"``:
the orthogonal decomposition instead, an ablation) plus a small MLP trained on the linear map's residual
gives the PATCH aligner. On held-out prefixes it then measures, per layer, the raw K/V
drift, the REUSE error, and the error *amplification*: the consumer's next-token KL divergence when
that layer alone is REUSE-decoded (or alone PATCHed) in an otherwise exact cache, and when that layer
alone is PATCHed with REUSE at every other layer (the codec's own context). The PATCH layers are the ones
where patching in that context removes the most downstream error (a fixed count, or ``auto``); a layer
whose patching does not lower the error there has gain 0 and is chosen last.
Ignored: joint optimisation of all layers, per-token rank allocation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from kvstate.models.fingerprint import model_fingerprint
from kvstate.transfer.codec import Codec, CodecConfig, CodecError
from kvstate.transfer.lowrank import (
    LowRankMap,
    fit_joint,
    fit_low_rank,
    fit_pca,
    relative_error,
    select_patch_layers,
)
from kvstate.transfer.states import build_cache, continue_logits, geometry, prefill_states
from kvstate.validate import check_float, check_int, check_token_ids

REUSE_MAPS = ("joint", "regress", "pca")
PATCH_MAPS = ("joint", "regress")
CALIBRATION_TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "qa", "vt", "text")


@dataclass(frozen=True)
class CalibrationConfig:
    rank_k: int = 16  # key code channels per KV head
    rank_v: int = 32  # value code channels per KV head
    rank_h: int = 64  # H_in code channels at PATCH layers
    patch: int | None = None  # PATCH layer count k; None = auto (select_patch_layers)
    bits: int = 8  # code precision on the wire
    prefixes: int = 24  # calibration prefixes (a quarter held out for the measurements)
    length: int = 512  # tokens per calibration prefix
    tasks: tuple[str, ...] = CALIBRATION_TASKS  # prefixes cycle over these synthetic tasks
    seed: int = 7919  # data stream of the prefixes (the evaluation uses other seeds)
    suffix: int = 16  # last tokens of a held-out prefix scored for the downstream error
    aligner_hidden: int = 256
    aligner_steps: int = 300
    aligner_lr: float = 3e-3
    ridge: float = 1e-6
    # REUSE maps: "joint" = producer principal code + orthogonal (Procrustes) decoder into the consumer;
    # ablations: "regress" = reduced-rank regression (stretches directions: loses multi-key retrieval);
    # "pca" = the producer's principal subspace decoded back into its own space (no cross-model map)
    reuse_map: str = "joint"
    # PATCH H_in maps: "joint" = the same angle-keeping decomposition as REUSE; "regress" = reduced-rank
    # regression (the least-squares fit: shrinks what it cannot predict towards the mean)
    patch_map: str = "regress"

    def __post_init__(self) -> None:
        def i(name: str, lo: int, hi: int, hint: str = "") -> None:
            check_int(f"CalibrationConfig.{name}", getattr(self, name), lo, hi, error=CodecError, hint=hint)

        i("prefixes", 4, 100_000, " (a quarter is held out)")
        if self.patch is not None:
            i("patch", 0, 1 << 16, " or None (auto)")
        i("length", 3, 1 << 20)
        i("suffix", 2, self.length - 1, f" (below length={self.length})")
        i("seed", 0, 2**31 - 1)
        i("aligner_hidden", 1, 1 << 16)
        i("aligner_steps", 0, 1 << 20)
        check_float("CalibrationConfig.aligner_lr", self.aligner_lr, 0.0, lo_open=True, error=CodecError)
        check_float("CalibrationConfig.ridge", self.ridge, 0.0, error=CodecError)
        if not isinstance(self.tasks, tuple) or not self.tasks or len(set(self.tasks)) != len(self.tasks):
            raise CodecError(f"CalibrationConfig.tasks={self.tasks!r} must be a non-empty tuple without repeats")
        if self.reuse_map not in REUSE_MAPS:
            raise CodecError(f"CalibrationConfig.reuse_map={self.reuse_map!r} must be one of {REUSE_MAPS}")
        if self.patch_map not in PATCH_MAPS:
            raise CodecError(f"CalibrationConfig.patch_map={self.patch_map!r} must be one of {PATCH_MAPS}")
        CodecConfig(self.rank_k, self.rank_v, self.rank_h, (), self.bits)


def _fit_map(cfg: CalibrationConfig, x: np.ndarray, y: np.ndarray, rank: int) -> LowRankMap:
    """One KV head's REUSE map of the kind ``cfg.reuse_map`` names."""
    if cfg.reuse_map == "joint":
        return fit_joint(x, y, rank)
    if cfg.reuse_map == "regress":
        return fit_low_rank(x, y, rank, cfg.ridge)
    return fit_pca(x, rank)


def _train_aligner(z: torch.Tensor, resid: torch.Tensor, cfg: CalibrationConfig, seed: int) -> dict[str, torch.Tensor]:
    """MLP ``resid ≈ gelu((z/std) W1ᵀ + b1) W2ᵀ + b2`` by Adam on MSE; W2, b2 start at zero."""
    with torch.inference_mode(False):
        return _train(z.clone(), resid.clone(), cfg, seed)


def _train(z: torch.Tensor, resid: torch.Tensor, cfg: CalibrationConfig, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    std = z.std(0).clamp_min(1e-6)
    perm = torch.randperm(z.shape[0], generator=gen)
    n_val = max(1, z.shape[0] // 5)
    val, tr = perm[:n_val], perm[n_val:]  # rows held out to decide whether the MLP helps at all
    w1 = (torch.randn(cfg.aligner_hidden, z.shape[1], generator=gen) / z.shape[1] ** 0.5).requires_grad_()
    b1 = torch.zeros(cfg.aligner_hidden, requires_grad=True)
    w2 = torch.zeros(resid.shape[1], cfg.aligner_hidden, requires_grad=True)
    b2 = torch.zeros(resid.shape[1], requires_grad=True)
    opt = torch.optim.Adam([w1, b1, w2, b2], lr=cfg.aligner_lr)
    zn = z / std

    def mlp(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(x @ w1.T + b1) @ w2.T + b2

    for _ in range(cfg.aligner_steps):
        idx = tr[torch.randint(0, len(tr), (min(1024, len(tr)),), generator=gen)]
        loss = torch.nn.functional.mse_loss(mlp(zn[idx]), resid[idx])
        opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
    with torch.no_grad():
        before = float(resid[val].pow(2).mean())
        after = float((resid[val] - mlp(zn[val])).pow(2).mean())
        if not after < 0.95 * before:  # the linear map already explains H_in: a noisy MLP would only add error
            w2.zero_()
            b2.zero_()
    return {"z_std": std, "w1": w1.detach(), "b1": b1.detach(), "w2": w2.detach(), "b2": b2.detach(),
            "val_mse": torch.tensor([before, min(before, after)])}


def _kl(ref: torch.Tensor, test: torch.Tensor) -> float:
    """Mean KL(ref || test) over rows of logits (T, V)."""
    lp, lq = torch.log_softmax(ref.double(), -1), torch.log_softmax(test.double(), -1)
    return float((lp.exp() * (lp - lq)).sum(-1).mean())


@torch.inference_mode()
def calibrate_on(producer: Any, consumer: Any, prompts: Sequence[torch.Tensor], cfg: CalibrationConfig,
                 progress: Callable[[str], None] | None = None) -> Codec:
    """Fit a codec on ``prompts`` (each (1, T)); the last quarter is held out for the measurements."""
    g = geometry(producer)
    if not prompts:
        raise CodecError("calibrate_on: no prompts; pass at least 4 calibration prefixes")
    for ids in prompts:
        for model in (producer, consumer):
            limit = getattr(model.config, "max_position_embeddings", None)
            check_token_ids("calibration prompt", ids, int(model.config.vocab_size),
                            max_len=limit if isinstance(limit, int) else None, error=CodecError)
    if geometry(consumer) != g:
        raise CodecError(f"producer {geometry(producer)} and consumer {geometry(consumer)} differ in shape; "
                         "SCD pairs must share the architecture")
    CodecConfig(cfg.rank_k, cfg.rank_v, cfg.rank_h, (), cfg.bits).check(g)
    tick = progress or (lambda _s: None)
    n_hold = max(1, len(prompts) // 4)
    fit, hold = prompts[:-n_hold], prompts[-n_hold:]
    acc: dict[str, list[list[torch.Tensor]]] = {n: [[] for _ in range(g.n_layers)] for n in ("hp", "hc", "kp", "kc", "vp", "vc")}
    for ids in fit:
        ps, cs = prefill_states(producer, ids), prefill_states(consumer, ids)
        for i in range(g.n_layers):
            for n, x in (("hp", ps.h[i]), ("hc", cs.h[i]), ("kp", ps.k[i]), ("kc", cs.k[i]), ("vp", ps.v[i]), ("vc", cs.v[i])):
                acc[n][i].append(x.float())
        tick("prefill")
    t: dict[str, torch.Tensor] = {}
    for i in range(g.n_layers):
        for name, rank in (("k", cfg.rank_k), ("v", cfg.rank_v)):
            xp, xc = torch.cat(acc[name + "p"][i]).numpy(), torch.cat(acc[name + "c"][i]).numpy()  # (N, H, D)
            maps = [_fit_map(cfg, xp[:, h], xc[:, h], rank) for h in range(g.n_kv_heads)]
            for part in ("encoder", "decoder", "mean_in", "mean_out"):
                key = {"encoder": "enc", "decoder": "dec", "mean_in": "mu_in", "mean_out": "mu_out"}[part]
                t[f"{name}.{i}.{key}"] = torch.from_numpy(np.stack([getattr(m, part) for m in maps]))
        hp, hc = torch.cat(acc["hp"][i]), torch.cat(acc["hc"][i])
        m = (fit_joint(hp.numpy(), hc.numpy(), cfg.rank_h) if cfg.patch_map == "joint"
             else fit_low_rank(hp.numpy(), hc.numpy(), cfg.rank_h, cfg.ridge))
        t.update({f"h.{i}.enc": torch.from_numpy(m.encoder), f"h.{i}.dec": torch.from_numpy(m.decoder),
                  f"h.{i}.mu_in": torch.from_numpy(m.mean_in), f"h.{i}.mu_out": torch.from_numpy(m.mean_out)})
        z = (hp - t[f"h.{i}.mu_in"]) @ t[f"h.{i}.enc"]
        resid = hc - (z @ t[f"h.{i}.dec"] + t[f"h.{i}.mu_out"])
        t.update({f"h.{i}.{k}": v for k, v in _train_aligner(z, resid, cfg, cfg.seed + i).items()})
        tick("fit")
    del acc
    codec = Codec(CodecConfig(cfg.rank_k, cfg.rank_v, cfg.rank_h, (), cfg.bits), g, model_fingerprint(producer),
                  model_fingerprint(consumer), t)
    info = measure(codec, producer, consumer, hold, cfg.suffix, tick)
    # the gain of patching layer i where the codec uses it: with REUSE at every other layer (in an otherwise exact
    # cache a layer can look worth patching while, next to REUSE layers, patching it costs retrieval)
    gain = [round(max(0.0, info["kl_all_layers"]["reuse"] - p), 6) for p in info["patch_in_context"]]
    patch = select_patch_layers(gain, None if cfg.patch is None else min(cfg.patch, g.n_layers))
    info.update(patch_gain=gain, config=asdict(cfg), fit_prefixes=len(fit), holdout_prefixes=len(hold),
                tokens=int(sum(p.shape[1] for p in fit)))
    return Codec(CodecConfig(cfg.rank_k, cfg.rank_v, cfg.rank_h, tuple(patch), cfg.bits), g, codec.producer_fp,
                 codec.consumer_fp, t, info)


@torch.inference_mode()
def measure(codec: Codec, producer: Any, consumer: Any, prompts: Sequence[torch.Tensor], suffix: int,
            tick: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Per-layer drift, REUSE / PATCH errors and downstream KL on ``prompts`` (see the module docstring)."""
    g, n = codec.geometry, codec.geometry.n_layers
    rows: dict[str, list[list[float]]] = {k: [] for k in (
        "raw_drift_k", "raw_drift_v", "reuse_err_k", "reuse_err_v", "patch_err_k", "patch_err_v",
        "impact_raw", "impact_reuse", "impact_patch", "patch_in_context")}
    whole: dict[str, list[float]] = {"raw": [], "reuse": [], "patch_all": []}
    for ids in prompts:
        cut = ids.shape[1] - suffix
        pre = ids[:, :cut]
        ps, cs = prefill_states(producer, pre), prefill_states(consumer, ids)
        ref = cs.logits[cut:]
        ck, cv = [k[:cut] for k in cs.k], [v[:cut] for v in cs.v]
        rk, rv = codec.decode_layers(consumer, codec.encode(producer, pre, patch=(), check=False), check=False)
        pk, pv = codec.decode_layers(consumer, codec.encode(producer, pre, patch=range(n), check=False), check=False)
        rows["raw_drift_k"].append([relative_error(ps.k[i], ck[i]) for i in range(n)])
        rows["raw_drift_v"].append([relative_error(ps.v[i], cv[i]) for i in range(n)])
        rows["reuse_err_k"].append([relative_error(rk[i], ck[i]) for i in range(n)])
        rows["reuse_err_v"].append([relative_error(rv[i], cv[i]) for i in range(n)])
        rows["patch_err_k"].append([relative_error(pk[i], ck[i]) for i in range(n)])
        rows["patch_err_v"].append([relative_error(pv[i], cv[i]) for i in range(n)])

        def kl_with(keys: list[torch.Tensor], values: list[torch.Tensor], ref: torch.Tensor = ref,
                    ids: torch.Tensor = ids, cut: int = cut) -> float:
            return _kl(ref, continue_logits(consumer, build_cache(consumer, keys, values), ids, cut))

        for name, (sk, sv) in (("impact_raw", (ps.k, ps.v)), ("impact_reuse", (rk, rv)), ("impact_patch", (pk, pv))):
            rows[name].append([kl_with([sk[j] if j == i else ck[j] for j in range(n)],
                                       [sv[j] if j == i else cv[j] for j in range(n)]) for i in range(n)])
        # the codec's own context: REUSE everywhere but layer i PATCHed (what a PATCH budget actually builds)
        rows["patch_in_context"].append([kl_with([pk[j] if j == i else rk[j] for j in range(n)],
                                                 [pv[j] if j == i else rv[j] for j in range(n)]) for i in range(n)])
        whole["raw"].append(kl_with(ps.k, ps.v))
        whole["reuse"].append(kl_with(rk, rv))
        whole["patch_all"].append(kl_with(pk, pv))
        if tick:
            tick("measure")
    out: dict[str, Any] = {k: [round(float(x), 6) for x in np.mean(v, axis=0)] for k, v in rows.items()}
    out["kl_all_layers"] = {k: round(float(np.mean(v)), 6) for k, v in whole.items()}
    out["amplification"] = [round(ri / max(1e-9, (ek + ev) / 2), 4) for ri, ek, ev in zip(
        out["impact_reuse"], out["reuse_err_k"], out["reuse_err_v"], strict=True)]
    _ = g
    return out
