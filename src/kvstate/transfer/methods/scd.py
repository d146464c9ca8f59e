"""Semantic Cache Distillation: REUSE codes at most layers, PATCH codes of the pre-attention input at the
codec's transition layers (the consumer regenerates their K/V with its own projections) — *Semantic Cache
Distillation: Efficient State Transfer via Reuse and Selective Patching* (``docs/techniques.md#across-models``).

``--option patch=0,2`` patches other layers than the calibrated ones (``patch=`` none: REUSE everywhere).
The bench adds the PATCH budget rows ``scd_k1`` .. ``scd_k4``: the k layers with the largest calibrated
patch gain (:func:`budget_layers`; k = 0 is ``reuse``). PATCH regenerates K/V from an aligned input, it does
not run the consumer's layer, so ``recomputed_layers`` is empty.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstate.transfer.codec import Codec
from kvstate.transfer.lowrank import select_patch_layers
from kvstate.transfer.methods.base import MethodContext, MethodError
from kvstate.transfer.methods.reuse import CodecMethod

MAX_BUDGET = 4  # PATCH budget rows scd_k1 .. scd_k4


def budget_layers(codec: Codec, k: int) -> list[int]:
    """The ``k`` PATCH layers with the largest calibrated patch gain (the transition layers)."""
    gain = codec.info.get("patch_gain") or [0.0] * codec.geometry.n_layers
    return select_patch_layers(gain, k)


def parse_layers(value: str, n_layers: int) -> tuple[int, ...]:
    """``--option patch=0,2`` (or empty: none) -> ascending layer indices in ``[0, n_layers)``."""
    try:
        layers = tuple(sorted({int(x) for x in value.split(",") if x.strip()}))
    except ValueError:
        raise MethodError(f"--option patch={value!r} is not a comma-separated list of layers, e.g. patch=0,2") from None
    bad = [i for i in layers if not 0 <= i < n_layers]
    if bad:
        raise MethodError(f"--option patch={value!r}: layers {bad} out of range; the codec has layers "
                          f"0..{n_layers - 1}")
    return layers


@dataclass(frozen=True, eq=False)
class SCD(CodecMethod):
    name: str = "scd"
    order: int = 70
    summary: str = "SCD: REUSE codes + PATCH codes at the codec's transition layers"
    option_keys: tuple[str, ...] = ("patch",)

    def patch(self, ctx: MethodContext) -> tuple[int, ...] | None:
        value = ctx.option("patch")
        return None if value is None else parse_layers(value, ctx.codec.geometry.n_layers)

    def check(self, ctx: MethodContext) -> None:
        super().check(ctx)
        self.patch(ctx)

    def bench_rows(self, ctx: MethodContext, extended: bool = True) -> dict[str, MethodContext]:
        rows = {self.name: ctx}
        if extended:
            for k in range(1, min(MAX_BUDGET, ctx.codec.geometry.n_layers) + 1):
                rows[f"{self.name}_k{k}"] = ctx.with_options(patch=",".join(map(str, budget_layers(ctx.codec, k))))
        return rows


METHODS = (SCD(),)
