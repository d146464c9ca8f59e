"""Ridge-mapped raw K/V: the producer ships its fp16 K/V (keys before rotary), the consumer maps them through
closed-form ridge maps fitted for the pair (:mod:`kvstate.transfer.ridge`) — the training-free per-head mapping
anchor of *Semantic Cache Distillation*'s real-pair issue (``docs/techniques.md#across-models``). Nothing is
recomputed; the wire carries what ``raw`` carries.

``ridge_head`` maps each KV head on its own (the anchor), ``ridge_layer`` a layer's K and V jointly. Both need the
fitted maps: :meth:`RidgeMapped.profile` fits them on the dev prompts it is given and writes a temporary file named
by the option ``artifact``; ``--option artifact=PATH`` uses maps fitted before. Maps fitted for another pair are
refused with one line naming the file.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvstate.transfer.methods.base import MethodContext, MethodError, TransferMethod, producer_states
from kvstate.transfer.methods.raw import finite_cache
from kvstate.transfer.nonlinear import MapError
from kvstate.transfer.payload import Payload, ids_hash
from kvstate.transfer.ridge import RidgeConfig, RidgeMaps, fit_ridge_maps
from kvstate.transfer.states import geometry

_LOADED: dict[tuple[str, float], RidgeMaps] = {}  # (path, mtime) -> maps


@dataclass(frozen=True, eq=False)
class RidgeMapped(TransferMethod):
    name: str = "ridge_head"
    order: int = 55
    scope: str = "head"
    summary: str = "the producer's fp16 K/V through closed-form per-head ridge maps fitted for the pair"
    option_keys: tuple[str, ...] = ("artifact",)
    calibration_prefixes: int = 16

    def maps(self, ctx: MethodContext) -> RidgeMaps:
        value = ctx.option("artifact")
        if value is None:
            raise MethodError(f"--method {self.name} needs its fitted maps: run its profile (the bench does) or pass "
                              f"--option artifact=PATH")
        p = Path(value)
        if not p.is_file():
            raise MethodError(f"--option artifact={value}: no such file; fit the maps (the method's profile) first")
        key = (str(p.resolve()), p.stat().st_mtime)
        if key not in _LOADED:
            try:
                m = RidgeMaps.load(p)
                m.check(ctx.codec.producer_fp, ctx.codec.consumer_fp)
            except MapError as exc:
                raise MethodError(f"--option artifact={value}: {exc}") from None
            if m.config.scope != self.scope:
                raise MethodError(f"--option artifact={value}: maps of scope {m.config.scope!r}; --method "
                                  f"{self.name} maps by {self.scope!r}")
            _LOADED[key] = m
        return _LOADED[key]

    def check(self, ctx: MethodContext) -> None:
        super().check(ctx)
        if ctx.option("artifact") is not None:
            self.maps(ctx)

    def encode(self, producer: Any, ids: torch.Tensor, ctx: MethodContext) -> Payload:
        keys, values, _ = producer_states(producer, ids)
        out: dict[str, torch.Tensor] = {}
        for i in keys:
            out[f"k.{i}"], out[f"v.{i}"] = keys[i].half().contiguous(), values[i].half().contiguous()
        return Payload(self.pair(ctx), ids.shape[1], ids_hash(ids[0].tolist()), out, {"method": self.name})

    def decode(self, consumer: Any, payload: Payload, ids: Sequence[int] | None, ctx: MethodContext) -> Any:
        self.check_payload(payload, ids, ctx)
        maps = self.maps(ctx)
        g, t = geometry(consumer), payload.n_tokens
        c = g.n_kv_heads * g.head_dim
        keys, values = [], []
        with torch.inference_mode():
            for i in range(g.n_layers):
                k, v = (payload.tensor(f"{n}.{i}", (t, c), torch.float16).float().view(t, g.n_kv_heads, g.head_dim)
                        for n in ("k", "v"))
                mk, mv = maps.apply(i, k, v)
                keys.append(mk)
                values.append(mv)
        return finite_cache(consumer, keys, values)

    def profile(self, producer: Any, consumer: Any, prompts: list[torch.Tensor],
                ctx: MethodContext) -> tuple[dict[str, str], dict[str, Any]]:
        dev = prompts if len(prompts) >= 2 else [prompts[0][:, : max(4, prompts[0].shape[1] * k // 4)] for k in (2, 4)]
        maps = fit_ridge_maps(producer, consumer, dev, RidgeConfig(scope=self.scope))
        path = Path(tempfile.mkdtemp(prefix="kvstate-ridge-")) / "ridge.safetensors"
        maps.save(path)
        return {"artifact": str(path)}, {"alphas": list(maps.alphas)}


METHODS = (RidgeMapped(),
           RidgeMapped(name="ridge_layer", order=56, scope="layer",
                       summary="the producer's fp16 K/V through closed-form ridge maps of each layer's K and V jointly"))
