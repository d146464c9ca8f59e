"""*DroidSpeak: KV Cache Sharing for Cross-LLM Communication and Multi-LLM Serving* as a transfer baseline.

Raw fp16 K/V for every layer outside one contiguous block ``[a, b)``; for the block the producer ships its
residual stream entering layer ``a`` (fp16, the paper's E cache) and the consumer recomputes the block with
its own weights. The block comes from the paper's offline profiling (:meth:`DroidSpeak.profile`): every
contiguous block is tried on dev prefixes (:func:`profile_blocks`, the consumer's next-token KL) and the
smallest block that removes the quality loss to within a tolerance is kept (:func:`choose_block`); without
a profiled ``--option block=A:B`` it recomputes every layer. Compared against *Semantic Cache Distillation*
(``docs/techniques.md#across-models``). Ignored: pipelining E-cache and KV loading (latency, not quality).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvstate.models.rotary import rotary_tables
from kvstate.transfer.methods.base import MethodContext, MethodError, TransferMethod, producer_states
from kvstate.transfer.methods.raw import RawKV, finite_cache
from kvstate.transfer.payload import Payload, PayloadError, ids_hash
from kvstate.transfer.states import capture_inputs, continue_logits, geometry, project_kv


def parse_block(value: str, n_layers: int, option: str = "--option block") -> tuple[int, int]:
    """DroidSpeak's block ``A:B`` (layers ``[A, B)``, ``0 <= A < B <= n_layers``)."""
    try:
        a, b = (int(x) for x in value.split(":"))
    except ValueError:
        raise MethodError(f"{option} {value!r} is not A:B (DroidSpeak recomputes layers A..B-1), e.g. {option} "
                          f"1:{n_layers}") from None
    if not 0 <= a < b <= n_layers:
        raise MethodError(f"{option} {value!r}: need 0 <= A < B <= {n_layers} (the codec's layers), e.g. "
                          f"{option} 1:{n_layers}")
    return a, b


def _kl(ref: torch.Tensor, test: torch.Tensor) -> float:
    lp, lq = torch.log_softmax(ref.double(), -1), torch.log_softmax(test.double(), -1)
    return float((lp.exp() * (lp - lq)).sum(-1).mean())


def choose_block(kl: dict[tuple[int, int], float], keep: float = 0.25) -> tuple[int, int]:
    """The smallest contiguous block whose KL is at most ``keep`` x raw reuse's (``kl[(0, 0)]``), the lowest KL
    among equals; if none is, the whole stack. DroidSpeak's choice of recompute layers under a quality bound."""
    if not 0.0 <= keep < 1.0:
        raise ValueError(f"choose_block: keep={keep} must be in [0, 1)")
    raw = kl[(0, 0)]
    ok = [(b - a, v, a, b) for (a, b), v in kl.items() if b > a and v <= keep * raw]
    if not ok:
        return max(((a, b) for a, b in kl if b > a), key=lambda blk: (blk[1] - blk[0], -kl[blk]))
    _, _, a, b = min(ok)
    return a, b


@dataclass(frozen=True, eq=False)
class DroidSpeak(TransferMethod):
    name: str = "droidspeak"
    order: int = 50
    keep: float = 0.25  # profiling's quality bound: the block's KL <= keep x raw reuse's
    summary: str = "raw fp16 K/V outside one layer block; the consumer recomputes the block from the residual"
    option_keys: tuple[str, ...] = ("block",)

    def block(self, ctx: MethodContext) -> tuple[int, int]:
        n = ctx.codec.geometry.n_layers
        value = ctx.option("block")
        return (0, n) if value is None else parse_block(value, n)

    def check(self, ctx: MethodContext) -> None:
        super().check(ctx)
        self.block(ctx)

    def recomputed_layers(self, ctx: MethodContext) -> tuple[int, ...]:
        a, b = self.block(ctx)
        return tuple(range(a, b))

    def encode(self, producer: Any, ids: torch.Tensor, ctx: MethodContext) -> Payload:
        a, b = self.block(ctx)
        keys, values, resid = producer_states(producer, ids, skip=range(a, b))
        out: dict[str, torch.Tensor] = {}
        for i in keys:
            out[f"k.{i}"], out[f"v.{i}"] = keys[i].half().contiguous(), values[i].half().contiguous()
        out["resid"] = resid[a].half().contiguous()  # (T, hidden): the residual stream entering layer a
        return Payload(self.pair(ctx), ids.shape[1], ids_hash(ids[0].tolist()), out,
                       {"method": self.name, "block": f"{a},{b}"})

    def decode(self, consumer: Any, payload: Payload, ids: Sequence[int] | None, ctx: MethodContext) -> Any:
        self.check_payload(payload, ids, ctx)
        g, t = geometry(consumer), payload.n_tokens
        try:
            a, b = (int(x) for x in payload.meta.get("block", "").split(","))
        except ValueError:
            raise PayloadError(f"payload block {payload.meta.get('block')!r} is not 'a,b'") from None
        if not 0 <= a < b <= g.n_layers:
            raise PayloadError(f"payload block [{a}, {b}) out of range for {g.n_layers} layers")
        c = g.n_kv_heads * g.head_dim
        keys: list[torch.Tensor | None] = [None] * g.n_layers
        values: list[torch.Tensor | None] = [None] * g.n_layers
        with torch.inference_mode():
            for i in [*range(a), *range(b, g.n_layers)]:
                keys[i], values[i] = (payload.tensor(f"{n}.{i}", (t, c), torch.float16).float()
                                      .view(t, g.n_kv_heads, g.head_dim) for n in ("k", "v"))
            h = payload.tensor("resid", (t, g.hidden_size), torch.float16)[None].to(next(consumer.parameters()).dtype)
            cos, sin = rotary_tables(consumer, torch.arange(t))
            with capture_inputs(consumer, "attn") as got:
                for i in range(a, b):
                    h = consumer.model.layers[i](h, attention_mask=None, position_ids=torch.arange(t)[None],
                                                 position_embeddings=(cos, sin))
                    keys[i], values[i] = project_kv(consumer, i, got[i][0])
        return finite_cache(consumer, keys, values)

    def profile(self, producer: Any, consumer: Any, prompts: list[torch.Tensor],
                ctx: MethodContext) -> tuple[dict[str, str], dict[str, Any]]:
        kl = profile_blocks(producer, consumer, prompts, ctx)
        a, b = choose_block(kl, self.keep)
        return {"block": f"{a}:{b}"}, {"profile_kl": {f"{x},{y}": round(v, 6) for (x, y), v in kl.items()},
                                       "keep": self.keep}


@torch.inference_mode()
def profile_blocks(producer: Any, consumer: Any, prompts: list[torch.Tensor], ctx: MethodContext,
                   suffix: int = 16) -> dict[tuple[int, int], float]:
    """DroidSpeak's offline profiling: for every contiguous block ``[a, b)`` (and ``(0, 0)`` = raw reuse,
    nothing recomputed) the consumer's mean next-token KL on the last ``suffix`` tokens of ``prompts``
    against its own prefill."""
    n = geometry(consumer).n_layers
    blocks = [(0, 0)] + [(a, b) for a in range(n) for b in range(a + 1, n + 1)]
    out = {blk: 0.0 for blk in blocks}
    raw, ds = RawKV(), DroidSpeak()
    for ids in prompts:
        cut = ids.shape[1] - suffix
        ref = continue_logits(consumer, None, ids, 0)[cut:]
        for blk in blocks:
            m: TransferMethod = raw if blk == (0, 0) else ds
            c = ctx if blk == (0, 0) else ctx.with_options(block=f"{blk[0]}:{blk[1]}")
            cache = m.decode(consumer, m.encode(producer, ids[:, :cut], c), None, c)
            out[blk] += _kl(ref, continue_logits(consumer, cache, ids, cut)) / len(prompts)
    return out


METHODS = (DroidSpeak(),)
