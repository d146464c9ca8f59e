"""Low-rank adapters for fine-tuning a consumer model on this machine, and their merge into its weights.

The technique is LoRA ("LoRA: Low-Rank Adaptation of Large Language Models", Hu et al. 2021): a frozen linear
map ``W`` gains a trainable update ``(alpha / r) * B @ A`` (``A``: r x in, random; ``B``: out x r, zeros, so
training starts at the base model). After training the update is *merged* (:func:`merge_into`): the consumer is
an ordinary model of the base's architecture whose weights differ, which is what a cross-model transfer needs
(the consumer's own K/V and residual stream drift from the producer's). The factors are what a repository can
carry (a few MB where the merged weights are hundreds): :func:`save_factors` writes them as safetensors (bf16 by
default) and :func:`merge_into` rebuilds the consumer from the base in float64, adding the rank-1 terms in a fixed
order (elementwise arithmetic, no BLAS reduction), so every machine gets the same fp32 weights from the same files.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kvstate.errors import InputFileError, KVStateError

FACTORS = "lora.safetensors"
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoraConfig:
    rank: int = 16
    alpha: float = 32.0
    targets: tuple[str, ...] = TARGETS  # the names of the decoder's linear maps that gain an adapter

    def __post_init__(self) -> None:
        if self.rank < 1 or not math.isfinite(self.alpha) or self.alpha <= 0:
            raise KVStateError(f"LoRA rank {self.rank} / alpha {self.alpha}: need rank >= 1 and alpha > 0")
        if not self.targets:
            raise KVStateError("LoRA targets are empty: name the linear maps to adapt, e.g. q_proj,k_proj,v_proj")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class LoraLinear(nn.Module):
    """``base(x) + scale * (x @ A^T) @ B^T`` with ``base`` frozen."""

    def __init__(self, base: nn.Linear, rank: int, scale: float, generator: torch.Generator) -> None:
        super().__init__()
        self.base, self.scale = base, scale
        for p in base.parameters():
            p.requires_grad_(False)
        bound = 1.0 / math.sqrt(base.in_features)  # nn.Linear's own init range, as LoRA's reference code does
        a = (torch.rand(rank, base.in_features, generator=generator) * 2 - 1) * bound
        self.lora_a = nn.Parameter(a.to(base.weight.dtype))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank, dtype=base.weight.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.t()) @ self.lora_b.t() * self.scale


def _targets(model: Any, cfg: LoraConfig) -> list[tuple[str, nn.Module, str, nn.Linear]]:
    found = []
    for name, module in model.named_modules():
        for child_name, child in module.named_children():
            if child_name in cfg.targets and isinstance(child, nn.Linear):
                found.append((f"{name}.{child_name}" if name else child_name, module, child_name, child))
    missing = set(cfg.targets) - {c for _, _, c, _ in found}
    if missing:
        raise KVStateError(f"LoRA targets {sorted(missing)} name no linear map of this model; its linear maps are "
                           f"{sorted({n.rsplit('.', 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})}")
    return found


def attach(model: Any, cfg: LoraConfig, seed: int) -> dict[str, LoraLinear]:
    """Freeze ``model`` and wrap every target linear map in a :class:`LoraLinear`; returns them by module name."""
    for p in model.parameters():
        p.requires_grad_(False)
    g = torch.Generator().manual_seed(seed)
    out: dict[str, LoraLinear] = {}
    for name, parent, child_name, child in _targets(model, cfg):
        wrapped = LoraLinear(child, cfg.rank, cfg.scale, g)
        setattr(parent, child_name, wrapped)
        out[name] = wrapped
    return out


def factors(adapters: Mapping[str, LoraLinear]) -> dict[str, torch.Tensor]:
    return {f"{n}.{k}": getattr(m, k).detach().contiguous() for n, m in adapters.items() for k in ("lora_a", "lora_b")}


def load_factors_into(adapters: Mapping[str, LoraLinear], tensors: Mapping[str, torch.Tensor], where: Path) -> None:
    want = set(factors(adapters))
    if set(tensors) != want:
        raise InputFileError(f"{where}: its LoRA factors do not match this model and config ({len(set(tensors) ^ want)} "
                             "names differ); resume with the config it was trained with")
    for n, m in adapters.items():
        for k in ("lora_a", "lora_b"):
            getattr(m, k).data.copy_(tensors[f"{n}.{k}"].to(getattr(m, k).dtype))


def save_factors(path: Path, tensors: Mapping[str, torch.Tensor], cfg: LoraConfig, meta: Mapping[str, Any],
                 dtype: torch.dtype = torch.bfloat16) -> None:
    from safetensors.torch import save_file

    save_file({k: v.to(dtype).contiguous() for k, v in tensors.items()}, str(path),
              metadata={"lora": json.dumps(asdict(cfg)), "meta": json.dumps(dict(meta), default=str)})


def read_factors(path: Path) -> tuple[dict[str, torch.Tensor], LoraConfig, dict[str, Any]]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            md = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a mapping)
        raw = json.loads(md["lora"])
        cfg = LoraConfig(rank=int(raw["rank"]), alpha=float(raw["alpha"]), targets=tuple(raw["targets"]))
        return tensors, cfg, json.loads(md.get("meta", "{}"))
    except (SafetensorError, OSError, KeyError, ValueError, TypeError) as exc:
        raise InputFileError(f"LoRA factors {str(path)!r} are missing, corrupt or not kvstate's "
                             f"({type(exc).__name__}: {exc}); restore the file from git") from None


@torch.no_grad()
def merge_into(model: Any, tensors: Mapping[str, torch.Tensor], cfg: LoraConfig, where: Path) -> int:
    """Add ``scale * B @ A`` to every adapted weight of a plain (un-wrapped) ``model`` in float64; returns how many
    weights changed. Refuses factors that name a module the model lacks or whose shapes do not fit."""
    modules = dict(model.named_modules())
    names = sorted({k.rsplit(".", 1)[0] for k in tensors})
    for n in names:
        lin = modules.get(n)
        a, b = tensors.get(f"{n}.lora_a"), tensors.get(f"{n}.lora_b")
        if not isinstance(lin, nn.Linear) or a is None or b is None or a.shape != (cfg.rank, lin.in_features) \
                or b.shape != (lin.out_features, cfg.rank):
            raise InputFileError(f"{where}: factor {n!r} does not fit this model (is it the base the factors were "
                                 "trained on?); rebuild from the base model named in the factors' card")
        w = lin.weight.double()
        b64, a64 = b.double(), a.double()
        for k in range(cfg.rank):  # outer products added in a fixed order: elementwise IEEE, no BLAS reduction
            w += cfg.scale * (b64[:, k:k + 1] * a64[k:k + 1, :])
        lin.weight.copy_(w.to(lin.weight.dtype))
    return len(names)


def trainable(adapters: Mapping[str, LoraLinear]) -> Iterable[nn.Parameter]:
    for m in adapters.values():
        yield m.lora_a
        yield m.lora_b


__all__ = ["FACTORS", "TARGETS", "LoraConfig", "LoraLinear", "attach", "factors", "load_factors_into", "merge_into",
           "read_factors", "save_factors", "trainable"]
