"""kvstate.transfer — state transfer across models: *Semantic Cache Distillation: Efficient State Transfer
via Reuse and Selective Patching* (REUSE low-rank codes + PATCH aligners), its baselines, the wire
format, payload stores and a TCP transport. See ``docs/techniques.md#across-models``."""

from kvstate.transfer.calibrate import CalibrationConfig, calibrate_on
from kvstate.transfer.codec import Codec, CodecConfig, CodecError
from kvstate.transfer.payload import FORMAT_VERSION, Payload, PayloadError, ids_hash
from kvstate.transfer.store import MemoryStore, RedisStore, StoreError, open_store
from kvstate.transfer.transport import (
    ProducerUnavailable,
    ServerConfig,
    ServerThread,
    TransportError,
    fetch_payload,
    hello,
)

__all__ = ["FORMAT_VERSION", "CalibrationConfig", "Codec", "CodecConfig", "CodecError", "MemoryStore", "Payload",
           "PayloadError", "ProducerUnavailable", "RedisStore", "ServerConfig", "ServerThread", "StoreError",
           "TransportError", "calibrate_on", "fetch_payload", "hello", "ids_hash", "open_store"]
