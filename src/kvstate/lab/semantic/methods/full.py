"""``full``: the uncompressed KV cache (a transformers ``DynamicCache``), the reference every method is
measured against (``docs/techniques.md#resolution``)."""

from __future__ import annotations

from typing import ClassVar

from kvstate.lab.semantic.methods.base import Uncompressed, register


class Full(Uncompressed):
    name: ClassVar[str] = "full"
    about: ClassVar[str] = "the full KV cache (no compression; the reference)"


register(Full())
