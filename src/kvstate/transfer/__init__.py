"""kvstate.transfer — state transfer across models: *Semantic Cache Distillation: Efficient State Transfer
via Reuse and Selective Patching* (REUSE low-rank codes + PATCH aligners), its baselines, the wire
format, payload stores and a TCP transport. See ``docs/techniques.md#across-models``."""

from kvstate.transfer.payload import FORMAT_VERSION, Payload, PayloadError, ids_hash

__all__ = ["FORMAT_VERSION", "Payload", "PayloadError", "ids_hash"]
