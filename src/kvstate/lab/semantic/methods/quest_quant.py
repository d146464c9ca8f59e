"""``quest4`` / ``quest2``: the Quest-like baseline with its pages stored quantized — SEKV's equal-memory twin.

SEKV's key-bound routing is Quest's bound, and its memory advantage over Quest-like is its quantized slow tier;
these rows give Quest-like the same tier. Everything is :mod:`~kvstate.lab.semantic.methods.quest`'s (sinks and
recent window at full precision, per page and KV head the element-wise min / max key in the fast tier, pages
ranked by the bound and read within the same read budget), except the paged middle: its keys are quantized per
channel within their page's min / max — the routing bound doubles as the quantizer's range, stored once, as
SEKV's slow tier stores its span bounds — and its values per token (each token's range over its channels), with
SEKV's quantizer (:mod:`kvstate.semantic.quant`, KIVI-style, at ``bits``). A read page is dequantized (the bytes
read are the dequantized K/V materialised, as SEKV's expanded spans are counted). The last page's padding is
not stored. No outlier pages are kept exact (SEKV keeps a share of its spans exact within its memory).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvstate.lab.semantic.methods.base import register
from kvstate.lab.semantic.methods.quest import PageStore, Quest, QuestCache
from kvstate.semantic.quant import QuantValues, _codes, _dequantize, pack, quantize_values, unpack


@dataclass
class QuantPageStore(PageStore):
    """A :class:`PageStore` whose slow tier is codes: ``slow_k`` / ``slow_v`` are empty (H, 0, D)."""

    k_codes: torch.Tensor | None = None  # (H, M, ceil(D * bits / 8)) uint8 key codes, per channel within the page
    v_quant: QuantValues | None = None  # the middle's values, per token
    bits: int = 4
    mid: int = 0  # tokens of the paged middle

    @property
    def n_mid(self) -> int:
        return self.mid

    def slow_nbytes(self) -> int:
        assert self.k_codes is not None and self.v_quant is not None
        return self.k_codes.nbytes + self.v_quant.nbytes

    def read_pages(self, tok: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.k_codes is not None and self.v_quant is not None
        d = self.page_min.shape[2]
        page = tok // self.page
        k = _dequantize(unpack(self.k_codes[:, tok], self.bits, d), self.page_min[:, page], self.page_max[:, page],
                        self.bits).to(dtype)
        vq = self.v_quant
        v = QuantValues(vq.codes[:, tok], vq.lo[:, tok], vq.hi[:, tok], self.bits, d).reconstruct(dtype)
        return k, v


def quantize_pages(store: PageStore, bits: int) -> QuantPageStore:
    """``store`` with its raw middle replaced by ``bits``-bit codes (keys within each page's min / max)."""
    h, m, d = store.slow_k.shape
    n_pages = store.page_min.shape[1]
    page = store.page
    pid = torch.arange(m) // page  # each middle token's page
    k_codes = pack(_codes(store.slow_k, store.page_min[:, pid], store.page_max[:, pid], bits), bits).contiguous()
    empty = store.slow_k.new_zeros(h, 0, d)
    assert n_pages * page >= m
    return QuantPageStore(store.anchor_k, store.anchor_v, store.page_min, store.page_max, empty, empty.clone(), page,
                          store.budget, store.top_k, store.route_query, k_codes=k_codes,
                          v_quant=quantize_values(store.slow_v, bits), bits=bits, mid=m)


class QuestQuantCache(QuestCache):
    """:class:`QuestCache` whose pages are held as ``bits``-bit codes."""

    bits = 4

    def compress(self, surprisal_values: Any = None) -> Any:
        super().compress(surprisal_values)
        for layer in self.semantic_layers:
            store = layer.store
            assert isinstance(store, PageStore)
            layer.store = quantize_pages(store, self.bits)
        return None


class QuestQuant4Cache(QuestQuantCache):
    bits = 4


class QuestQuant2Cache(QuestQuantCache):
    bits = 2


class Quest4(Quest):
    name: ClassVar[str] = "quest4"
    about: ClassVar[str] = "Quest-like with 4-bit pages (SEKV's quantizer): the equal-memory twin of SEKV"
    cache_class: ClassVar[type] = QuestQuant4Cache


class Quest2(Quest):
    name: ClassVar[str] = "quest2"
    about: ClassVar[str] = "Quest-like with 2-bit pages (SEKV's quantizer): the equal-memory twin of 2-bit SEKV"
    cache_class: ClassVar[type] = QuestQuant2Cache


register(Quest4())
register(Quest2())
