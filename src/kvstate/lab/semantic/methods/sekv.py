"""``sekv`` and its ablations: the SEKV cache (:mod:`kvstate.semantic`) as the benchmark runs it.

From "SEKV: Resolution-Adaptive Semantic KV Cache with Hierarchical Semantic Memory"
(``docs/techniques.md#resolution``): the context compressed into anchors and spans by its surprisal, spans
ranked by their key bounds and expanded within the read budget, a budgeted sticky working set, the slow tier
under ``memory`` (or ``slow_budget``), low-rank or quantized (:class:`~kvstate.lab.semantic.methods.base.SekvOptions`).

- ``sekv``: as above (the proposed method); an unexpanded span is not attended (``summaries=False``: Quest's
  reads), so the fast tier is the anchors and the bounds and the rest of the read budget goes to expansions;
- ``sekv_summaries``: every unexpanded span attended as its summary entry (mean key + log |S|, mean value), the
  paper's low-resolution tier — which costs two vectors per span and head of the fast tier;
- ``sekv_fresh``: deciding afresh at every pass (no working set; shares ``sekv``'s compression when no
  memory cap sizes the slow tier beside the working set);
- ``sekv_raw``: the slow tier kept raw (rank = full): what low rank / quantization costs;
- ``sekv_learned``: the paper's learned routing instead of the bounds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from typing import Any, ClassVar

from kvstate.lab.semantic.methods.base import Context, Prefilled, Role, StoreMethod, register
from kvstate.semantic.config import SemanticConfig, Slow
from kvstate.semantic.router import SemanticRouter


class Sekv(StoreMethod):
    name: ClassVar[str] = "sekv"
    role: ClassVar[Role] = "proposed"
    about: ClassVar[str] = "SEKV: spans routed by key bounds, sticky working set, low-rank or quantized slow tier"
    sticky: ClassVar[bool] = True
    routing: ClassVar[str] = "bounds"
    raw: ClassVar[bool] = False
    summaries: ClassVar[bool] = False

    def config(self, budget: float, ctx: Context) -> SemanticConfig:
        if ctx.config is not None:
            return ctx.config
        o = ctx.options
        slow: Slow = "raw" if self.raw else o.slow  # type: ignore[assignment]
        return SemanticConfig(budget=budget, segment=ctx.segment, slow_budget=ctx.slow_budget, sticky=self.sticky,
                              slow=slow, bits=o.bits, memory=o.memory, routing=self.routing,  # type: ignore[arg-type]
                              expand_share=ctx.expand_share, summaries=self.summaries)

    def router(self, ctx: Context) -> SemanticRouter | None:
        return ctx.router

    def compress(self, cache: Any, tokenizer: Any, context: list[int], pre: Prefilled) -> None:
        cache.compress(pre.surprisal)

    def share_key(self, budget: float, ctx: Context) -> Hashable | None:
        cfg = self.config(budget, ctx)
        # without a memory cap, sticky is the one setting compression does not read
        return dataclasses.replace(cfg, sticky=False) if cfg.memory is None else cfg

    def fork(self, cache: Any, budget: float, ctx: Context) -> Any:
        return cache.fork(self.config(budget, ctx))

    def expanded(self, cache: Any) -> float | None:
        return float(cache.expanded_fraction())

    def slow_log(self, cache: Any) -> dict[str, Any] | None:
        return dict(cache.slow_tier())


class SekvFresh(Sekv):
    name: ClassVar[str] = "sekv_fresh"
    role: ClassVar[Role] = "ablation"
    about: ClassVar[str] = "SEKV deciding afresh at every pass (no working set)"
    sticky: ClassVar[bool] = False


class SekvRaw(Sekv):
    name: ClassVar[str] = "sekv_raw"
    role: ClassVar[Role] = "ablation"
    about: ClassVar[str] = "SEKV with the slow tier kept raw (the low-rank / quantization ablation)"
    raw: ClassVar[bool] = True


class SekvLearned(Sekv):
    name: ClassVar[str] = "sekv_learned"
    role: ClassVar[Role] = "ablation"
    about: ClassVar[str] = "SEKV with the paper's learned routing instead of key bounds (the routing ablation)"
    routing: ClassVar[str] = "learned"
    summaries: ClassVar[bool] = True  # learned routing needs the summary entries for the spans it leaves out


class SekvSummaries(Sekv):
    name: ClassVar[str] = "sekv_summaries"
    role: ClassVar[Role] = "ablation"
    about: ClassVar[str] = "SEKV attending every unexpanded span as its summary entry (the paper's low-resolution tier)"
    summaries: ClassVar[bool] = True


for _m in (Sekv(), SekvFresh(), SekvRaw(), SekvLearned(), SekvSummaries()):
    register(_m)
