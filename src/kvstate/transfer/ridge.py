"""Closed-form ridge maps from a producer's K/V to a consumer's, keys without rotary.

The training-free cross-model mapping of the 2026 anchor of *Semantic Cache Distillation*'s issue (a per-head ridge
regression from the sender's cache to the receiver's, fitted in closed form on a few calibration prompts; see
``docs/techniques.md#across-models``): for every layer an affine map, fitted by ridge regression on paired states
of the same tokens — the producer's keys before rotary and values (``X``) against the consumer's own (``Y``) —
so the consumer applies its own rotary to mapped keys and a position never enters the map.

- ``scope="head"`` (the anchor): each KV head's keys from that head's keys, its values from its values
  (``D + 1 -> D`` per head);
- ``scope="layer"``: a layer's keys and values from the layer's keys and values together (``2 C + 1 -> 2 C``,
  ``C = H_kv x D``), which can also move information between heads and between K and V.

Fitting streams sufficient statistics (``Xᵀ X``, ``Xᵀ Y`` per layer, float64), so calibration memory does not grow
with tokens; the ridge strength is relative to the mean variance of the inputs and chosen per layer from
:data:`ALPHAS` by the squared error on the last calibration prompt (fitted on the others), then refitted on all.
The maps, with the two models' fingerprints, are one safetensors file (:meth:`RidgeMaps.save`); maps fitted for
another pair are refused.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from kvstate.models.fingerprint import model_fingerprint
from kvstate.transfer.nonlinear import MapError, read_artifact, write_artifact

RIDGE_VERSION = 1
SCOPES = ("head", "layer")
ALPHAS = (1e-4, 1e-3, 1e-2, 1e-1)


@dataclass(frozen=True)
class RidgeConfig:
    """How the maps are fitted."""

    scope: str = "head"  # "head" (per KV head, K from K and V from V) or "layer" (a layer's K and V jointly)

    def __post_init__(self) -> None:
        if self.scope not in SCOPES:
            raise MapError(f"RidgeConfig: scope {self.scope!r} is not one of {', '.join(SCOPES)}")


class _Stats:
    """Sufficient statistics of one layer's regression ``[x, 1] -> y`` (float64)."""

    def __init__(self, d_in: int, d_out: int) -> None:
        self.xx = torch.zeros(d_in + 1, d_in + 1, dtype=torch.float64)
        self.xy = torch.zeros(d_in + 1, d_out, dtype=torch.float64)

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        x1 = torch.cat([x.double(), torch.ones(x.shape[0], 1, dtype=torch.float64)], 1)
        self.xx += x1.T @ x1
        self.xy += x1.T @ y.double()

    def plus(self, other: _Stats) -> _Stats:
        out = _Stats(self.xx.shape[0] - 1, self.xy.shape[1])
        out.xx, out.xy = self.xx + other.xx, self.xy + other.xy
        return out


def solve(xx: torch.Tensor, xy: torch.Tensor, alpha: float) -> torch.Tensor:
    """The ridge solution ``W`` ((d_in + 1), d_out) of ``[x, 1] W ≈ y`` from its statistics; the penalty is
    ``alpha`` x the inputs' mean variance per sample, on the centred inputs (the bias is not penalised)."""
    n = xx[-1, -1]
    mean = xx[-1, :-1] / n
    cov = xx[:-1, :-1] / n - torch.outer(mean, mean)
    lam = alpha * float(torch.diagonal(cov).mean().clamp_min(1e-12))
    reg = torch.zeros_like(xx)
    reg[:-1, :-1] = lam * n * torch.eye(xx.shape[0] - 1, dtype=xx.dtype)
    return torch.as_tensor(torch.linalg.solve(xx + reg, xy))


def _blocks(scope: str, h: int, d: int) -> list[tuple[list[int], list[int]]]:
    """(input channels, output channels) of each regression within a layer's ``[K, V]`` (2 H D channels)."""
    c = h * d
    if scope == "layer":
        return [(list(range(2 * c)), list(range(2 * c)))]
    out = []
    for part in (0, c):
        for j in range(h):
            ch = list(range(part + j * d, part + (j + 1) * d))
            out.append((ch, ch))
    return out


def _sub(xx: torch.Tensor, xy: torch.Tensor, cin: list[int], cout: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    idx = torch.tensor([*cin, xx.shape[0] - 1])
    return xx[idx][:, idx], xy[idx][:, torch.tensor(cout)]


@dataclass
class RidgeMaps:
    """Per-layer affine maps ``[K, V]`` (producer, keys before rotary) -> ``[K, V]`` (consumer)."""

    producer_fp: str
    consumer_fp: str
    n_layers: int
    n_kv_heads: int
    head_dim: int
    config: RidgeConfig
    tensors: dict[str, torch.Tensor]  # "{layer}.{block}": (d_in + 1, d_out) float32
    alphas: tuple[float, ...] = ()  # the ridge strength chosen per layer

    def __post_init__(self) -> None:
        blocks = _blocks(self.config.scope, self.n_kv_heads, self.head_dim)
        for i in range(self.n_layers):
            for b, (cin, cout) in enumerate(blocks):
                t = self.tensors.get(f"{i}.{b}")
                if (not isinstance(t, torch.Tensor) or tuple(t.shape) != (len(cin) + 1, len(cout))
                        or not bool(torch.isfinite(t).all())):
                    raise MapError(f"RidgeMaps: tensor '{i}.{b}' is missing, misshapen or not finite; refit the maps")

    def check(self, producer_fp: str, consumer_fp: str) -> None:
        """Raise :class:`MapError` unless these maps were fitted for this producer and consumer."""
        for role, want, got in (("producer", self.producer_fp, producer_fp), ("consumer", self.consumer_fp, consumer_fp)):
            if want != got:
                raise MapError(f"these ridge maps were fitted for another {role} ({want[:12]}…, this one is "
                               f"{got[:12]}…); refit them for this pair (the method's profile)")

    def apply(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The consumer's keys (before rotary) and values (T, H, D) at ``layer`` from the producer's."""
        if not 0 <= layer < self.n_layers:
            raise MapError(f"RidgeMaps: no map for layer {layer}; these maps cover 0..{self.n_layers - 1}")
        t, h, d = k.shape
        x = torch.cat([k.reshape(t, -1), v.reshape(t, -1)], 1).float()
        y = torch.empty_like(x)
        for b, (cin, cout) in enumerate(_blocks(self.config.scope, h, d)):
            w = self.tensors[f"{layer}.{b}"]
            y[:, cout] = x[:, cin] @ w[:-1] + w[-1]
        c = h * d
        return y[:, :c].reshape(t, h, d), y[:, c:].reshape(t, h, d)

    def identity(self) -> dict[str, Any]:
        return {"version": RIDGE_VERSION, "producer_fp": self.producer_fp, "consumer_fp": self.consumer_fp,
                "n_layers": self.n_layers, "n_kv_heads": self.n_kv_heads, "head_dim": self.head_dim,
                "config": asdict(self.config), "alphas": list(self.alphas)}

    def save(self, path: str | Path) -> Path:
        return write_artifact(path, self.tensors, self.identity())

    @classmethod
    def load(cls, path: str | Path) -> RidgeMaps:
        meta, tensors = read_artifact(path, "ridge-map", "refit the maps (the method's profile)")
        try:
            if meta["version"] != RIDGE_VERSION:
                raise MapError(f"ridge maps {str(path)!r} have version {meta['version']}; this kvstate reads "
                               f"{RIDGE_VERSION}")
            return cls(meta["producer_fp"], meta["consumer_fp"], meta["n_layers"], meta["n_kv_heads"],
                       meta["head_dim"], RidgeConfig(**meta["config"]), tensors, tuple(meta["alphas"]))
        except (KeyError, TypeError) as exc:
            raise MapError(f"{str(path)!r} is not a kvstate ridge-map file ({exc!r}); refit the maps") from None


def _layer_xy(states: Any, i: int) -> torch.Tensor:
    t = states.k[i].shape[0]
    return torch.cat([states.k[i].reshape(t, -1), states.v[i].reshape(t, -1)], 1).double()


@torch.inference_mode()
def fit_ridge_maps(producer: Any, consumer: Any, prompts: Sequence[torch.Tensor], cfg: RidgeConfig,
                   progress: Callable[[str], None] | None = None) -> RidgeMaps:
    """Fit the maps on ``prompts`` (each (1, T); at least two: the last one chooses each layer's ridge strength)
    from one prefill of each on both models."""
    from kvstate.transfer.states import geometry, prefill_states

    if len(prompts) < 2:
        raise MapError(f"fit_ridge_maps: need at least 2 calibration prompts (the last holds out), got {len(prompts)}")
    g = geometry(consumer)
    if geometry(producer) != g:
        raise MapError("fit_ridge_maps: producer and consumer differ in geometry; a ridge map needs one shape")
    c2 = 2 * g.n_kv_heads * g.head_dim
    fit = [_Stats(c2, c2) for _ in range(g.n_layers)]
    held: list[tuple[torch.Tensor, torch.Tensor]] = []
    for n, ids in enumerate(prompts):
        ps, cs = prefill_states(producer, ids), prefill_states(consumer, ids)
        last = n == len(prompts) - 1
        for i in range(g.n_layers):
            x, y = _layer_xy(ps, i), _layer_xy(cs, i)
            if last:
                held.append((x, y))
            else:
                fit[i].add(x, y)
        if progress:
            progress(f"ridge maps: prompt {n + 1}/{len(prompts)} prefilled")
    blocks = _blocks(cfg.scope, g.n_kv_heads, g.head_dim)
    tensors: dict[str, torch.Tensor] = {}
    alphas = []
    for i in range(g.n_layers):
        x, y = held[i]
        errors = {}
        for a in ALPHAS:
            err = 0.0
            for cin, cout in blocks:
                w = solve(*_sub(fit[i].xx, fit[i].xy, cin, cout), a)
                err += float(((x[:, cin] @ w[:-1] + w[-1] - y[:, cout]) ** 2).sum())
            errors[a] = err
        best = min(ALPHAS, key=lambda a: (errors[a], a))
        alphas.append(best)
        last = _Stats(c2, c2)
        last.add(x, y)
        total = fit[i].plus(last)
        for b, (cin, cout) in enumerate(blocks):
            tensors[f"{i}.{b}"] = solve(*_sub(total.xx, total.xy, cin, cout), best).float().contiguous()
    return RidgeMaps(model_fingerprint(producer), model_fingerprint(consumer), g.n_layers, g.n_kv_heads, g.head_dim,
                     cfg, tensors, tuple(alphas))


__all__ = ["ALPHAS", "SCOPES", "RidgeConfig", "RidgeMaps", "fit_ridge_maps", "solve"]
