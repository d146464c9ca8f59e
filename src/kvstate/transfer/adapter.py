"""Cache-conditioned adaptation: a LoRA adapter that teaches the consumer to read a transferred cache.

The strongest option for cross-model transfer in ``docs/techniques.md#across-models``: rather than
mapping the producer's state ever closer to the consumer's, the consumer learns to answer from the mapped
cache it is given — the idea of PrefillShare's cache-conditioned fine-tuning and of *KVLink: Accelerating
Large Language Models via Efficient KV Cache Reuse*, here as low-rank adapters (*LoRA: Low-Rank Adaptation
of Large Language Models*) on the consumer's attention and MLP projections. Training: for calibration
prompts the transferred cache of the prefix comes from a codec (any ``transfer(prefix ids) -> (keys,
values)``); the consumer, adapter on, runs the suffix over it; the loss is the KL divergence from the
consumer's own full-prefill next-token distribution (distillation); both models stay frozen, only the
adapter trains.

The adapter is applied only while a transferred cache is being decoded (:meth:`Adapter.applied`, forward
hooks removed on exit): with no payload the consumer's behaviour is exactly the base model's. It targets
the query / output projections and the MLP, never the key / value projections, so the K/V the transferred
cache holds keep their meaning. It carries both models' fingerprints and the pair of the codec whose cache
it was trained on, and ships with that codec; another pair is refused with one error naming it. Ignored:
merging the adapter into the weights (a merged adapter could not be switched off per request).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from kvstate.errors import KVStateError
from kvstate.models.fingerprint import model_fingerprint
from kvstate.validate import check_float, check_int

ADAPTER_VERSION = 1
TARGETS = ("q_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # never k_proj / v_proj


class AdapterError(KVStateError):
    """An adapter that does not fit: another model pair or codec, bad settings or files."""


@dataclass(frozen=True)
class AdapterConfig:
    rank: int = 8
    alpha: float = 16.0  # the update is scaled by alpha / rank
    targets: tuple[str, ...] = TARGETS
    steps: int = 300  # Adam steps, one prompt each
    lr: float = 1e-3
    suffix: int = 16  # last tokens of each calibration prompt scored (they end with their answers)
    seed: int = 0

    def __post_init__(self) -> None:
        for name, lo in (("rank", 1), ("steps", 0), ("suffix", 1), ("seed", 0)):
            check_int(f"AdapterConfig.{name}", getattr(self, name), lo, 1 << 24, error=AdapterError)
        for name in ("alpha", "lr"):
            check_float(f"AdapterConfig.{name}", getattr(self, name), 0.0, lo_open=True, error=AdapterError)
        if not self.targets or not set(self.targets) <= set(TARGETS) or len(set(self.targets)) != len(self.targets):
            raise AdapterError(f"AdapterConfig.targets={self.targets!r} must be distinct names of {TARGETS}")


def _modules(model: Any, targets: Sequence[str]) -> dict[str, Any]:
    """``{"{layer}.{target}": nn.Linear}`` of every targeted projection."""
    out = {}
    for i, layer in enumerate(model.model.layers):
        for name in targets:
            parent = layer.self_attn if name in ("q_proj", "o_proj") else layer.mlp
            mod = getattr(parent, name, None)
            if not isinstance(mod, torch.nn.Linear):
                raise AdapterError(f"layer {i} has no linear {name}; adapters support Qwen3 / Llama-style layers")
            out[f"{i}.{name}"] = mod
    return out


@dataclass
class Adapter:
    producer_fp: str
    consumer_fp: str
    codec_pair: str  # hex pair of the codec whose transferred cache the adapter reads
    config: AdapterConfig
    tensors: dict[str, torch.Tensor]  # "{layer}.{target}.a" (rank, in), ".b" (out, rank)

    def check(self, producer_fp: str, consumer_fp: str, codec_pair: str) -> None:
        """Raise :class:`AdapterError` unless trained for this producer, consumer and codec."""
        for role, want, got in (("producer", self.producer_fp, producer_fp), ("consumer", self.consumer_fp, consumer_fp),
                                ("codec", self.codec_pair, codec_pair)):
            if want != got:
                raise AdapterError(f"this adapter was trained for another {role} ({want[:12]}…, this one is "
                                   f"{got[:12]}…); train one for this pair with kvstate.transfer.adapter.train_adapter")

    @contextmanager
    def applied(self, model: Any, consumer_fp: str | None = None) -> Iterator[None]:
        """The adapter on ``model`` inside the ``with`` (hooks always removed). ``consumer_fp``: the model's
        fingerprint when the caller has it (checked; computing it hashes every weight)."""
        if consumer_fp is not None and consumer_fp != self.consumer_fp:
            self.check(self.producer_fp, consumer_fp, self.codec_pair)
        with lora(model, self.tensors, self.config):
            yield

    def identity(self) -> dict[str, Any]:
        return {"version": ADAPTER_VERSION, "producer_fp": self.producer_fp, "consumer_fp": self.consumer_fp,
                "codec_pair": self.codec_pair, "config": asdict(self.config)}

    def save(self, path: str | Path) -> Path:
        from kvstate.transfer.nonlinear import write_artifact

        return write_artifact(path, self.tensors, self.identity())

    @classmethod
    def load(cls, path: str | Path) -> Adapter:
        from kvstate.transfer.nonlinear import MapError, read_artifact

        try:
            meta, tensors = read_artifact(path, "adapter", "retrain the adapter")
        except MapError as exc:
            raise AdapterError(str(exc)) from None
        try:
            if meta["version"] != ADAPTER_VERSION:
                raise AdapterError(f"adapter {str(path)!r} has version {meta['version']}; this kvstate reads "
                                   f"{ADAPTER_VERSION}")
            cfg = meta["config"]
            return cls(meta["producer_fp"], meta["consumer_fp"], meta["codec_pair"],
                       AdapterConfig(**{**cfg, "targets": tuple(cfg["targets"])}), tensors)
        except (KeyError, TypeError) as exc:
            raise AdapterError(f"{str(path)!r} is not a kvstate adapter file ({exc!r}); retrain the adapter") from None


@contextmanager
def lora(model: Any, tensors: dict[str, torch.Tensor], cfg: AdapterConfig) -> Iterator[None]:
    """Forward hooks adding ``(alpha / rank) * x Aᵀ Bᵀ`` to each targeted projection's output; removed on exit."""
    mods = _modules(model, cfg.targets)
    scale = cfg.alpha / cfg.rank
    handles = []

    def hook(a: torch.Tensor, b: torch.Tensor) -> Any:
        def fn(_mod: Any, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
            return torch.as_tensor(out + scale * ((args[0].to(a.dtype) @ a.T) @ b.T).to(out.dtype))
        return fn

    try:
        for name, mod in mods.items():
            a, b = tensors.get(f"{name}.a"), tensors.get(f"{name}.b")
            if a is None or b is None or a.shape != (cfg.rank, mod.in_features) or b.shape != (mod.out_features, cfg.rank):
                raise AdapterError(f"adapter tensors for {name} are missing or mis-shaped for this model "
                                   f"(rank {cfg.rank}, {mod.in_features} -> {mod.out_features}); retrain the adapter")
            handles.append(mod.register_forward_hook(hook(a, b)))
        yield
    finally:
        for h in handles:
            h.remove()


def init_tensors(model: Any, cfg: AdapterConfig) -> dict[str, torch.Tensor]:
    """LoRA's initialisation: A random (Kaiming-uniform scale), B zero — the adapter starts as the identity."""
    gen = torch.Generator().manual_seed(cfg.seed)
    out = {}
    for name, mod in _modules(model, cfg.targets).items():
        bound = 1.0 / mod.in_features ** 0.5
        out[f"{name}.a"] = (torch.rand(cfg.rank, mod.in_features, generator=gen) * 2 - 1) * bound
        out[f"{name}.b"] = torch.zeros(mod.out_features, cfg.rank)
    return out


def train_adapter(producer_fp: str, consumer: Any, codec_pair: str,
                  transfer: Callable[[torch.Tensor], tuple[list[torch.Tensor], list[torch.Tensor]]],
                  prompts: Sequence[torch.Tensor], cfg: AdapterConfig,
                  progress: Callable[[str], None] | None = None) -> Adapter:
    """Train an adapter for ``consumer`` to answer from ``transfer(prefix ids (1, T'))`` — the codec's consumer
    keys (pre-rotary) / values per layer — on ``prompts`` (each (1, T), ending with its answer)."""
    from kvstate.transfer.nonlinear import Frozen, kl_div, kl_tune, suffix_logits

    if not prompts:
        raise AdapterError("train_adapter: no prompts; pass calibration prompts ending with their answers")
    data = []
    with torch.inference_mode():
        for ids in prompts:
            if ids.shape[1] <= cfg.suffix + 1:
                raise AdapterError(f"train_adapter: a prompt of {ids.shape[1]} tokens is not longer than suffix + 1 = "
                                   f"{cfg.suffix + 1}")
            cut = ids.shape[1] - cfg.suffix
            ref = torch.as_tensor(consumer(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None],
                                           use_cache=False).logits[0, cut:]).float().clone()
            keys, values = transfer(ids[:, :cut])
            data.append((ids, cut, [k.clone() for k in keys], [v.clone() for v in values], ref))
    tensors = init_tensors(consumer, cfg)
    gen = torch.Generator().manual_seed(cfg.seed + 1)

    def loss(_step: int) -> torch.Tensor:
        ids, cut, keys, values, ref = data[int(torch.randint(0, len(data), (1,), generator=gen))]
        with lora(consumer, tensors, cfg):
            return kl_div(ref, suffix_logits(consumer, keys, values, ids, cut))

    with Frozen(consumer):
        kl_tune(list(tensors.values()), loss, cfg.steps, cfg.lr,
                (lambda s: progress(s) if s.split("/")[0].endswith("0") else None) if progress else None)
    return Adapter(producer_fp, model_fingerprint(consumer), codec_pair, cfg,
                   {k: v.detach().clone() for k, v in tensors.items()})


__all__ = ["Adapter", "AdapterConfig", "AdapterError", "init_tensors", "lora", "train_adapter"]
