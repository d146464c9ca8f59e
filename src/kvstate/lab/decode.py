"""The lab's name for the one greedy decode loop: :mod:`kvstate.models.decode` (re-exported here).

Greedy decoding (batch 1) with explicit positions; the library module holds the one implementation so the
server's decode step and the lab's measurements share it.
"""

from __future__ import annotations

from kvstate.models.decode import DecodeResult, as_ids, forward_at, greedy_decode

__all__ = ["DecodeResult", "as_ids", "forward_at", "greedy_decode"]
