"""kvstate.transfer — state transfer across models: *Semantic Cache Distillation: Efficient State Transfer
via Reuse and Selective Patching* (REUSE low-rank codes + PATCH aligners), its baselines as registered
methods (:mod:`kvstate.transfer.methods`), the wire format, payload stores and a TCP transport. See
``docs/techniques.md#across-models``.

Names load on first use (torch with them), so ``kvstate --help`` and the command-line wiring of
:mod:`kvstate.transfer.cli` do not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOME = {
    "CalibrationConfig": "calibrate", "calibrate_on": "calibrate",
    "Codec": "codec", "CodecConfig": "codec", "CodecError": "codec",
    "FORMAT_VERSION": "payload", "Payload": "payload", "PayloadError": "payload", "ids_hash": "payload",
    "MemoryStore": "store", "RedisStore": "store", "StoreError": "store", "open_store": "store",
    "ProducerUnavailable": "transport", "ServerConfig": "transport", "ServerThread": "transport",
    "TransportError": "transport", "fetch_payload": "transport", "hello": "transport",
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'kvstate.transfer' has no attribute {name!r}")
    return getattr(importlib.import_module(f"kvstate.transfer.{home}"), name)


__all__ = sorted(_HOME)
