"""Learned nonlinear maps from a producer's state to a consumer's: a per-layer projector, an alternative to
the linear REUSE decoder of *Semantic Cache Distillation: Efficient State Transfer via Reuse and Selective
Patching* (``docs/techniques.md#across-models``).

Where two models' states are not linearly related, a linear map per layer leaves most of the consumer's
error in place. The map here follows the per-layer projector of *Cache-to-Cache: Direct Semantic
Communication Between Large Language Models* (C2C's fuser), used to *replace* the consumer's K/V rather than
enrich it: ``y = [x, 1] W + MLP(x / std)`` — a ridge-regression linear part plus a small GELU MLP on the
standardised input that learns what the linear part cannot (its output layer starts at zero, so training
starts from the linear fit). It is fitted on calibration pairs (mean squared error, Adam) with both models
frozen; :func:`kl_tune` then fine-tunes it on the consumer's own next-token KL divergence given the mapped
cache (the loss that matters downstream).

:class:`KVMaps` applies one map per layer to what a codec ships for that layer — the producer's K/V as the
SCD codec's REUSE code (its principal coordinates; at full rank the producer's K/V themselves) — together
with the consumer's own embedding of each token (free on the consumer: it has the token ids), and returns
the consumer's keys (before rotary) and values. The maps carry both models' fingerprints and the codec's
pair: maps trained for another pair are refused with one error naming it. Ignored: attention-output error
as a loss term (the next-token KL already covers what attention reads), per-token rank adaptation.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from kvstate.errors import KVStateError
from kvstate.models.fingerprint import model_fingerprint
from kvstate.validate import check_float, check_int

MAPS_VERSION = 1


class MapError(KVStateError):
    """A learned map that does not fit: another model pair, another codec, bad shapes or settings."""


@dataclass(frozen=True)
class MapConfig:
    """How one per-layer map is fitted."""

    hidden: int = 256  # MLP width
    steps: int = 400  # Adam steps on mean squared error
    lr: float = 3e-3
    batch: int = 1024  # rows per step
    ridge: float = 1e-3  # of the linear part
    seed: int = 0
    kl_steps: int = 0  # Adam steps on the consumer's next-token KL (kl_tune), 0 = none
    kl_lr: float = 5e-4

    def __post_init__(self) -> None:
        for name, lo in (("hidden", 1), ("steps", 0), ("batch", 1), ("seed", 0), ("kl_steps", 0)):
            check_int(f"MapConfig.{name}", getattr(self, name), lo, 1 << 24, error=MapError)
        for name in ("lr", "kl_lr"):
            check_float(f"MapConfig.{name}", getattr(self, name), 0.0, lo_open=True, error=MapError)
        check_float("MapConfig.ridge", self.ridge, 0.0, error=MapError)


MAP_PARTS = ("w_lin", "x_std", "w1", "b1", "w2", "b2")


def map_shapes(n_in: int, n_out: int, hidden: int) -> dict[str, tuple[int, ...]]:
    return {"w_lin": (n_in + 1, n_out), "x_std": (n_in,), "w1": (hidden, n_in), "b1": (hidden,),
            "w2": (n_out, hidden), "b2": (n_out,)}


def apply_map(t: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``y`` (N, out) of the map ``t`` at ``x`` (N, in): linear part + MLP on the standardised input."""
    lin = x @ t["w_lin"][:-1] + t["w_lin"][-1]
    hid = torch.nn.functional.gelu((x / t["x_std"]) @ t["w1"].T + t["b1"])
    return lin + hid @ t["w2"].T + t["b2"]


def fit_linear(x: torch.Tensor, y: torch.Tensor, ridge: float) -> torch.Tensor:
    """Ridge regression ``[x, 1] W ≈ y`` (W: (in + 1, out)), solved in float64; the bias is not penalised."""
    x1 = torch.cat([x.double(), torch.ones(x.shape[0], 1, dtype=torch.float64)], 1)
    reg = ridge * x1.shape[0] * torch.eye(x1.shape[1], dtype=torch.float64)
    reg[-1, -1] = 0.0
    return torch.as_tensor(torch.linalg.solve(x1.T @ x1 + reg, x1.T @ y.double())).float()


def fit_map(x: torch.Tensor, y: torch.Tensor, cfg: MapConfig) -> dict[str, torch.Tensor]:
    """A map ``x`` (N, in) -> ``y`` (N, out): the ridge fit, then the MLP trained on mean squared error
    (``cfg.steps`` Adam steps; with 0 steps the map is the linear fit)."""
    if x.dim() != 2 or y.dim() != 2 or x.shape[0] != y.shape[0] or x.shape[0] < 2:
        raise MapError(f"fit_map: x {tuple(x.shape)} and y {tuple(y.shape)} must be (N, in) and (N, out) with the "
                       "same N >= 2")
    if not (bool(torch.isfinite(x).all()) and bool(torch.isfinite(y).all())):
        raise MapError("fit_map: x and y must be finite")
    x, y = x.float(), y.float()
    gen = torch.Generator().manual_seed(cfg.seed)
    t = {"w_lin": fit_linear(x, y, cfg.ridge), "x_std": x.std(0).clamp_min(1e-6),
         "w1": torch.randn(cfg.hidden, x.shape[1], generator=gen) / x.shape[1] ** 0.5,
         "b1": torch.zeros(cfg.hidden), "w2": torch.zeros(y.shape[1], cfg.hidden), "b2": torch.zeros(y.shape[1])}
    if cfg.steps == 0:
        return t
    with torch.inference_mode(False), torch.enable_grad():
        xs, ys = x.clone(), y.clone()
        params = {k: v.clone().requires_grad_(k in ("w1", "b1", "w2", "b2")) for k, v in t.items()}
        opt = torch.optim.Adam([v for v in params.values() if v.requires_grad], lr=cfg.lr)
        for _ in range(cfg.steps):
            idx = torch.randint(0, xs.shape[0], (min(cfg.batch, xs.shape[0]),), generator=gen)
            loss = torch.nn.functional.mse_loss(apply_map(params, xs[idx]), ys[idx])
            opt.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
        return {k: v.detach().clone() for k, v in params.items()}


def kl_div(ref: torch.Tensor, test: torch.Tensor) -> torch.Tensor:
    """Mean KL(ref || test) over rows of logits (T, V), differentiable in ``test``."""
    lp, lq = torch.log_softmax(ref.float(), -1), torch.log_softmax(test.float(), -1)
    return (lp.exp() * (lp - lq)).sum(-1).mean()


def kl_tune(params: Iterable[torch.Tensor], loss_fn: Callable[[int], torch.Tensor], steps: int, lr: float,
            progress: Callable[[str], None] | None = None) -> list[float]:
    """Adam on ``params`` (tensors made trainable in place) for ``steps`` steps of ``loss_fn(step)`` (e.g. the
    consumer's next-token KL given a mapped cache); returns the losses. Both models stay frozen: only
    ``params`` are optimised."""
    ps = list(params)
    losses: list[float] = []
    with torch.inference_mode(False), torch.enable_grad():
        for p in ps:
            p.requires_grad_(True)
        opt = torch.optim.Adam(ps, lr=lr)
        for step in range(steps):
            loss = loss_fn(step)
            opt.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
            losses.append(float(loss.detach()))
            if progress:
                progress(f"kl step {step + 1}/{steps}: {losses[-1]:.4f}")
        for p in ps:
            p.requires_grad_(False)
    return losses


class Frozen:
    """Context: ``model``'s parameters stop requiring grad (a loss through a frozen model)."""

    def __init__(self, model: Any) -> None:
        self.model, self.was = model, [p.requires_grad for p in model.parameters()]

    def __enter__(self) -> None:
        for p in self.model.parameters():
            p.requires_grad_(False)

    def __exit__(self, *_exc: object) -> None:
        for p, w in zip(self.model.parameters(), self.was, strict=True):
            p.requires_grad_(w)


def suffix_logits(consumer: Any, keys: list[torch.Tensor], values: list[torch.Tensor], ids: torch.Tensor,
                  cut: int) -> torch.Tensor:
    """Logits (T - cut, V) of ``ids[:, cut:]`` over a cache of ``keys`` / ``values`` (differentiable)."""
    from kvstate.transfer.states import build_cache

    cache = build_cache(consumer, keys, values)
    out = consumer(input_ids=ids[:, cut:], position_ids=torch.arange(cut, ids.shape[1])[None], cache=cache,
                   use_cache=True)
    return torch.as_tensor(out.logits[0]).float()


@dataclass
class KVMaps:
    """Per-layer nonlinear maps: (a layer's REUSE code, the consumer's token embedding) -> consumer K/V."""

    producer_fp: str
    consumer_fp: str
    codec_pair: str  # hex pair of the SCD codec whose REUSE codes the maps read
    n_kv_heads: int
    head_dim: int
    hidden_size: int
    layers: tuple[int, ...]  # the layers with a map
    tensors: dict[str, torch.Tensor]  # "{layer}.{part}"
    config: MapConfig

    def __post_init__(self) -> None:
        for i in self.layers:
            for part in MAP_PARTS:
                t = self.tensors.get(f"{i}.{part}")
                if not isinstance(t, torch.Tensor) or not bool(torch.isfinite(t).all()):
                    raise MapError(f"KVMaps: tensor '{i}.{part}' is missing or not finite; retrain the maps")
            out = self.tensors[f"{i}.b2"].shape[0]
            if out != 2 * self.n_kv_heads * self.head_dim:
                raise MapError(f"KVMaps: layer {i} maps to {out} channels, expected 2 x {self.n_kv_heads} x "
                               f"{self.head_dim}; retrain the maps")

    def check(self, producer_fp: str, consumer_fp: str, codec_pair: str) -> None:
        """Raise :class:`MapError` unless these maps were trained for this producer, consumer and codec."""
        for role, want, got in (("producer", self.producer_fp, producer_fp), ("consumer", self.consumer_fp, consumer_fp),
                                ("codec", self.codec_pair, codec_pair)):
            if want != got:
                raise MapError(f"these nonlinear maps were trained for another {role} ({want[:12]}…, this one is "
                               f"{got[:12]}…); train maps for this pair with kvstate.transfer.nonlinear.train_kv_maps")

    def apply(self, layer: int, code: torch.Tensor, embed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Consumer keys (pre-rotary) and values (T, H, D) at ``layer`` from its REUSE code (T, C) and the
        consumer's token embeddings (T, hidden)."""
        if layer not in self.layers:
            raise MapError(f"KVMaps: no map for layer {layer}; these maps cover layers {list(self.layers)}")
        t = {p: self.tensors[f"{layer}.{p}"] for p in MAP_PARTS}
        y = apply_map(t, torch.cat([code.float(), embed.float()], 1))
        c = self.n_kv_heads * self.head_dim
        k, v = y[:, :c], y[:, c:]
        return (k.reshape(-1, self.n_kv_heads, self.head_dim), v.reshape(-1, self.n_kv_heads, self.head_dim))

    def identity(self) -> dict[str, Any]:
        return {"version": MAPS_VERSION, "producer_fp": self.producer_fp, "consumer_fp": self.consumer_fp,
                "codec_pair": self.codec_pair, "n_kv_heads": self.n_kv_heads, "head_dim": self.head_dim,
                "hidden_size": self.hidden_size, "layers": list(self.layers), "config": asdict(self.config)}

    def save(self, path: str | Path) -> Path:
        return write_artifact(path, self.tensors, self.identity())

    @classmethod
    def load(cls, path: str | Path) -> KVMaps:
        meta, tensors = read_artifact(path, "nonlinear-map", "retrain the maps")
        try:
            if meta["version"] != MAPS_VERSION:
                raise MapError(f"maps {str(path)!r} have version {meta['version']}; this kvstate reads {MAPS_VERSION}")
            return cls(meta["producer_fp"], meta["consumer_fp"], meta["codec_pair"], meta["n_kv_heads"],
                       meta["head_dim"], meta["hidden_size"], tuple(meta["layers"]), tensors,
                       MapConfig(**meta["config"]))
        except (KeyError, TypeError) as exc:
            raise MapError(f"{str(path)!r} is not a kvstate nonlinear-map file ({exc!r}); retrain the maps") from None


def write_artifact(path: str | Path, tensors: dict[str, torch.Tensor], identity: dict[str, Any]) -> Path:
    """One safetensors file (the tensors, ``identity`` as its ``kvstate`` metadata), written whole or not at all
    (serialized in memory, then written to a sibling and renamed over ``path``); what :func:`read_artifact` reads."""
    from safetensors.torch import save as save_bytes

    from kvstate.io_safety import write_bytes_atomic

    p = Path(path)
    write_bytes_atomic(p, save_bytes({k: v.contiguous() for k, v in tensors.items()},
                                     metadata={"kvstate": json.dumps(identity, sort_keys=True)}))
    return p


def read_artifact(path: str | Path, kind: str, fix: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(the ``kvstate`` metadata, the tensors) of a safetensors file written by a map's or adapter's ``save``;
    :class:`MapError` naming the file on anything else."""
    from safetensors import safe_open

    from kvstate.errors import IntegrityError
    from kvstate.integrity import check_safetensors_header

    bad = f"{str(path)!r} is not a kvstate {kind} file"
    try:
        check_safetensors_header(path)
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {})["kvstate"])
        tensors = load_file(str(path))
    except (OSError, IntegrityError, KeyError, json.JSONDecodeError) as exc:
        raise MapError(f"{bad} ({exc}); {fix}") from None
    except Exception as exc:  # safetensors' own error types: a sound header over an unparseable body
        raise MapError(f"{bad} ({exc}); {fix}") from None
    if not isinstance(meta, dict):
        raise MapError(f"{bad} (metadata is not an object); {fix}")
    return meta, tensors


def train_kv_maps(producer: Any, consumer: Any, codec: Any, prompts: Sequence[torch.Tensor], layers: Sequence[int],
                  cfg: MapConfig, progress: Callable[[str], None] | None = None) -> KVMaps:
    """Fit a map per layer in ``layers`` from the SCD ``codec``'s REUSE code of the producer's K/V (and the
    consumer's token embedding) to the consumer's K/V, on ``prompts`` (each (1, T)); both models frozen."""
    from kvstate.transfer.states import geometry, prefill_states

    g = geometry(consumer)
    bad = [i for i in layers if not 0 <= i < g.n_layers]
    if bad or not layers:
        raise MapError(f"train_kv_maps: layers {list(layers)} must be a non-empty subset of 0..{g.n_layers - 1}")
    xs: dict[int, list[torch.Tensor]] = {i: [] for i in layers}
    ys: dict[int, list[torch.Tensor]] = {i: [] for i in layers}
    with torch.inference_mode():
        for ids in prompts:
            ps, cs = prefill_states(producer, ids), prefill_states(consumer, ids)
            emb = consumer.model.embed_tokens(ids)[0].float()
            for i in layers:
                code = reuse_code(codec, i, ps.k[i].float(), ps.v[i].float())
                xs[i].append(torch.cat([code, emb], 1))
                ys[i].append(torch.cat([cs.k[i].reshape(ids.shape[1], -1), cs.v[i].reshape(ids.shape[1], -1)], 1).float())
    tensors: dict[str, torch.Tensor] = {}
    for i in layers:
        fitted = fit_map(torch.cat(xs[i]), torch.cat(ys[i]), MapConfig(**{**asdict(cfg), "seed": cfg.seed + i}))
        tensors.update({f"{i}.{k}": v for k, v in fitted.items()})
        if progress:
            progress(f"map layer {i}")
    maps = KVMaps(model_fingerprint(producer), model_fingerprint(consumer), codec.pair.hex(), g.n_kv_heads,
                  g.head_dim, g.hidden_size, tuple(layers), tensors, cfg)
    return kl_tune_kv_maps(maps, producer, consumer, codec, prompts, progress=progress) if cfg.kl_steps else maps


@torch.inference_mode()
def decode_reuse(maps: KVMaps, codec: Any, consumer: Any, payload: Any,
                 token_ids: Sequence[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Consumer keys (pre-rotary) and values per layer from an SCD REUSE payload (``codec.encode(...,
    patch=())``): the maps decode the layers they cover, the codec's linear decoders the rest. Raises
    :class:`~kvstate.transfer.payload.PayloadError` on a payload for another pair or other tokens."""
    from kvstate.transfer.codec import REUSE, Codec
    from kvstate.transfer.payload import PayloadError

    maps.check(codec.producer_fp, codec.consumer_fp, codec.pair.hex())
    payload.check(codec.pair, token_ids)
    g = codec.geometry
    if set(payload.meta.get("modes", "")) != {REUSE} or len(payload.meta["modes"]) != g.n_layers:
        raise PayloadError(f"nonlinear maps decode REUSE payloads (patch=()); got modes {payload.meta.get('modes')!r}")
    keys, values = codec.decode_layers(consumer, payload, token_ids, check=False)
    ids = torch.as_tensor(list(token_ids)[: payload.n_tokens], dtype=torch.long)[None]
    emb = consumer.model.embed_tokens(ids)[0].float()
    b, t = int(payload.meta["bits"]), payload.n_tokens
    for i in maps.layers:
        zk = Codec._codes(payload, f"k.{i}", t, g.n_kv_heads * codec.config.rank_k, b)
        zv = Codec._codes(payload, f"v.{i}", t, g.n_kv_heads * codec.config.rank_v, b)
        keys[i], values[i] = maps.apply(i, torch.cat([zk, zv], 1), emb)
    return keys, values


def kl_tune_kv_maps(maps: KVMaps, producer: Any, consumer: Any, codec: Any, prompts: Sequence[torch.Tensor],
                    suffix: int = 16, progress: Callable[[str], None] | None = None) -> KVMaps:
    """Fine-tune every layer's map at once on the consumer's next-token KL over the last ``suffix`` tokens of
    ``prompts`` given the cache the maps decode (the codec's linear decoders at layers without a map); both
    models frozen, ``maps.config.kl_steps`` Adam steps at ``kl_lr``."""
    from kvstate.transfer.states import prefill_states

    cfg, g = maps.config, codec.geometry
    data = []
    with torch.inference_mode():
        for ids in prompts:
            cut = ids.shape[1] - suffix
            if cut < 1:
                raise MapError(f"kl_tune_kv_maps: a prompt of {ids.shape[1]} tokens is not longer than suffix={suffix}")
            ref = prefill_states(consumer, ids).logits[cut:].clone()
            ps = prefill_states(producer, ids[:, :cut])
            emb = consumer.model.embed_tokens(ids[:, :cut])[0].float().clone()
            codes = {i: reuse_code(codec, i, ps.k[i].float(), ps.v[i].float()).clone() for i in maps.layers}
            lin_k, lin_v = codec.decode_layers(consumer, codec.encode(producer, ids[:, :cut], patch=(), check=False),
                                               check=False)
            data.append((ids, cut, ref, emb, codes, [k.clone() for k in lin_k], [v.clone() for v in lin_v]))
    params = {k: v.clone() for k, v in maps.tensors.items()}
    gen = torch.Generator().manual_seed(cfg.seed + 17)
    c = g.n_kv_heads * g.head_dim

    def loss(_step: int) -> torch.Tensor:
        ids, cut, ref, emb, codes, lin_k, lin_v = data[int(torch.randint(0, len(data), (1,), generator=gen))]
        keys, values = list(lin_k), list(lin_v)
        for i in maps.layers:
            y = apply_map({p: params[f"{i}.{p}"] for p in MAP_PARTS}, torch.cat([codes[i], emb], 1))
            keys[i] = y[:, :c].reshape(-1, g.n_kv_heads, g.head_dim)
            values[i] = y[:, c:].reshape(-1, g.n_kv_heads, g.head_dim)
        return kl_div(ref, suffix_logits(consumer, keys, values, ids, cut))

    trainable = [params[f"{i}.{p}"] for i in maps.layers for p in ("w_lin", "w1", "b1", "w2", "b2")]
    with Frozen(consumer):
        kl_tune(trainable, loss, cfg.kl_steps, cfg.kl_lr, progress)
    return KVMaps(maps.producer_fp, maps.consumer_fp, maps.codec_pair, maps.n_kv_heads, maps.head_dim,
                  maps.hidden_size, maps.layers, {k: v.detach().clone() for k, v in params.items()}, cfg)


def reuse_code(codec: Any, layer: int, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The SCD codec's REUSE code (T, H * (rank_k + rank_v)) of a layer's producer keys / values (T, H, D)."""
    w = codec.tensors
    out = []
    for name, x in (("k", k), ("v", v)):
        z = torch.einsum("thd,hdr->thr", x - w[f"{name}.{layer}.mu_in"], w[f"{name}.{layer}.enc"])
        out.append(z.reshape(x.shape[0], -1))
    return torch.cat(out, 1)


__all__ = ["Frozen", "KVMaps", "MapConfig", "MapError", "apply_map", "decode_reuse", "fit_linear", "fit_map", "kl_div",
           "kl_tune", "kl_tune_kv_maps", "read_artifact", "reuse_code", "suffix_logits", "train_kv_maps"]
