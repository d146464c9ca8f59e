"""Selective recompute and learned nonlinear maps as registered transfer methods.

- ``scd_recompute``: the consumer recomputes one layer exactly from a mapped boundary stream and takes
  the SCD codec's REUSE codes elsewhere (:mod:`kvstate.transfer.recompute`, extending *Semantic Cache
  Distillation: Efficient State Transfer via Reuse and Selective Patching* with *DroidSpeak*'s recompute;
  ``docs/techniques.md#across-models``); its nonlinear variant also decodes the REUSE codes with learned
  maps (:mod:`kvstate.transfer.nonlinear`).
- ``reuse_nonlinear``: the REUSE payload at every layer, decoded by learned nonlinear maps (nothing
  recomputed).

Both need a trained artifact: :meth:`profile` fits it on the dev prompts it is given (the recompute layer
by the consumer's next-token KL per candidate layer) and writes it to a temporary file named by the option
``artifact``; ``--option artifact=PATH`` uses one trained before (``RecomputeCodec.save`` /
``KVMaps.save``). An artifact trained for another pair or codec is refused with one line naming it.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvstate.transfer.methods.base import MethodContext, MethodError, TransferMethod
from kvstate.transfer.nonlinear import KVMaps, MapConfig, MapError, decode_reuse, train_kv_maps
from kvstate.transfer.payload import Payload
from kvstate.transfer.recompute import METHOD, RecomputeCodec, calibrate_recompute
from kvstate.transfer.states import build_cache

_LOADED: dict[tuple[str, float, bytes], Any] = {}  # (path, mtime, codec pair) -> loaded artifact


def _artifact_path(name: str, ctx: MethodContext) -> Path:
    value = ctx.option("artifact")
    if value is None:
        raise MethodError(f"--method {name} needs its trained artifact: run its profile (the bench does) or pass "
                          f"--option artifact=PATH")
    p = Path(value)
    if not p.is_file():
        raise MethodError(f"--option artifact={value}: no such file; train one (the method's profile) first")
    return p


def _dev_prompts(prompts: list[torch.Tensor], suffix: int) -> list[torch.Tensor]:
    """At least two prompts for fitting and holding out: a single prompt gives its prefixes."""
    if len(prompts) >= 2:
        return prompts
    ids = prompts[0]
    t = ids.shape[1]
    return [ids[:, : max(suffix + 2, t * k // 4)] for k in (2, 3, 4)]


@dataclass(frozen=True, eq=False)
class ScdRecompute(TransferMethod):
    name: str = METHOD
    order: int = 110
    summary: str = "recompute one profiled consumer layer from a mapped boundary stream; REUSE codes elsewhere"
    option_keys: tuple[str, ...] = ("artifact",)
    nonlinear: bool = False  # the nonlinear variant: MLP boundary map, learned maps on the REUSE codes
    rank: int = 64
    suffix: int = 16
    calibration_prefixes: int = 48  # the boundary map trains: 4 prefixes left layer 1's held-out KL at 0.51 (48: 0.03)

    def codec(self, ctx: MethodContext) -> RecomputeCodec:
        p = _artifact_path(self.name, ctx)
        key = (str(p.resolve()), p.stat().st_mtime, ctx.codec.pair)
        if key not in _LOADED:
            _LOADED[key] = RecomputeCodec.load(p, ctx.codec)
        rc = _LOADED[key]
        if not isinstance(rc, RecomputeCodec) or (rc.maps is not None) != self.nonlinear:
            raise MethodError(f"--option artifact={p} is not a {self.name} codec")
        return rc

    def check(self, ctx: MethodContext) -> None:
        super().check(ctx)
        if ctx.option("artifact") is not None:
            self.codec(ctx)

    def pair(self, ctx: MethodContext) -> bytes:
        return self.codec(ctx).pair

    def recomputed_layers(self, ctx: MethodContext) -> tuple[int, ...]:
        return (self.codec(ctx).config.layer,)

    def encode(self, producer: Any, ids: torch.Tensor, ctx: MethodContext) -> Payload:
        return self.codec(ctx).encode(producer, ids, check=False)

    def decode(self, consumer: Any, payload: Payload, ids: Sequence[int] | None, ctx: MethodContext) -> Any:
        if ids is None:
            raise MethodError(f"--method {self.name} decodes with the prompt's token ids (the consumer embeds them)")
        return self.codec(ctx).decode(consumer, payload, ids, check=False)

    def profile(self, producer: Any, consumer: Any, prompts: list[torch.Tensor],
                ctx: MethodContext) -> tuple[dict[str, str], dict[str, Any]]:
        dev = _dev_prompts(prompts, self.suffix)
        maps = None
        if self.nonlinear:
            maps = train_kv_maps(producer, consumer, ctx.codec, dev, range(ctx.codec.geometry.n_layers), MapConfig())
        suffix = min(self.suffix, min(p.shape[1] for p in dev) - 2)
        rc = calibrate_recompute(producer, consumer, ctx.codec, dev, rank=self.rank,
                                 map_cfg=MapConfig(steps=400 if self.nonlinear else 0), maps=maps, suffix=suffix)
        path = Path(tempfile.mkdtemp(prefix="kvstate-recompute-")) / "recompute.safetensors"
        rc.save(path)
        return {"artifact": str(path)}, {"layer": rc.config.layer, "kl_by_layer": rc.info["kl_by_layer"],
                                         "modes": rc.modes}


@dataclass(frozen=True, eq=False)
class ReuseNonlinear(TransferMethod):
    name: str = "reuse_nonlinear"
    order: int = 105
    summary: str = "SCD's REUSE codes at every layer, decoded by learned nonlinear maps; nothing recomputed"
    option_keys: tuple[str, ...] = ("artifact",)
    calibration_prefixes: int = 48  # the maps train on the calibration stream

    def maps(self, ctx: MethodContext) -> KVMaps:
        p = _artifact_path(self.name, ctx)
        key = (str(p.resolve()), p.stat().st_mtime, ctx.codec.pair)
        if key not in _LOADED:
            m = KVMaps.load(p)
            try:
                m.check(ctx.codec.producer_fp, ctx.codec.consumer_fp, ctx.codec.pair.hex())
            except MapError as exc:
                raise MethodError(f"--option artifact={p}: {exc}") from None
            _LOADED[key] = m
        got = _LOADED[key]
        assert isinstance(got, KVMaps)
        return got

    def check(self, ctx: MethodContext) -> None:
        super().check(ctx)
        if ctx.option("artifact") is not None:
            self.maps(ctx)

    def pair(self, ctx: MethodContext) -> bytes:
        return ctx.codec.pair

    def encode(self, producer: Any, ids: torch.Tensor, ctx: MethodContext) -> Payload:
        self.maps(ctx)
        return ctx.codec.encode(producer, ids, patch=(), check=False)

    def decode(self, consumer: Any, payload: Payload, ids: Sequence[int] | None, ctx: MethodContext) -> Any:
        if ids is None:
            raise MethodError(f"--method {self.name} decodes with the prompt's token ids (the consumer embeds them)")
        return build_cache(consumer, *decode_reuse(self.maps(ctx), ctx.codec, consumer, payload, ids))

    def profile(self, producer: Any, consumer: Any, prompts: list[torch.Tensor],
                ctx: MethodContext) -> tuple[dict[str, str], dict[str, Any]]:
        maps = train_kv_maps(producer, consumer, ctx.codec, prompts, range(ctx.codec.geometry.n_layers), MapConfig())
        path = Path(tempfile.mkdtemp(prefix="kvstate-maps-")) / "maps.safetensors"
        maps.save(path)
        return {"artifact": str(path)}, {"layers": list(maps.layers)}


METHODS = (ScdRecompute(), ScdRecompute(name="scd_recompute_nonlinear", order=111, nonlinear=True,
                                        summary="scd_recompute with learned nonlinear boundary and REUSE maps"),
           ReuseNonlinear())
