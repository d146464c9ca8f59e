"""The time-to-first-token table of a transfer result (``kvstate transfer ttft``): its cells and rendering, shared
by the toy pairs' section and the real pair's (Semantic Cache Distillation, ``../shared/seeds/``; DroidSpeak's
TTFT over a shaped link)."""

from __future__ import annotations

from typing import Any

from kvstate.lab.report.html import Table

REFERENCE = "oracle"  # the row every other is scored against, when a file does not name its own
TTFT_RATE, TTFT_LENGTH, TTFT_FACTOR = "1", 8192, 2.0  # the target: warm >= 2x faster than the oracle at 8K, 1 Gbit/s


def ttft_cells(ttft: dict[str, Any]) -> dict[tuple[str, int, str], dict[str, Any]]:
    """``(method, length, rate key) -> {cold, warm, cold_range, warm_range, achieved, bytes_per_token}``."""
    out = {}
    for r in ttft.get("rows") or []:
        for key, t in (r.get("ttft_ms") or {}).items():
            rng = (r.get("ttft_range_ms") or {}).get(key) or {}
            out[(r["method"], int(r["length"]), key)] = {
                "cold": t["cold"], "warm": t["warm"], "cold_range": rng.get("cold") or [t["cold"]] * 2,
                "warm_range": rng.get("warm") or [t["warm"]] * 2, "n": r.get("n"),
                "achieved": (r.get("achieved_gbit_s") or {}).get(key),
                "bytes_per_token": r.get("payload_bytes_per_token", 0.0), "agrees": r.get("first_token_agrees")}
    return out


def rate_label(key: str, links: dict[str, Any]) -> str:
    link = links.get(key) or {}
    achieved = link.get("achieved_gbit_s")
    shown = "loopback (unshaped)" if link.get("rate_gbit", key) is None else f"{key} Gbit/s"
    return f"{shown}, achieved {achieved:.3g}" if isinstance(achieved, (int, float)) else shown


def ttft_table(ttft: dict[str, Any], label: str) -> Table:
    """TTFT cold / warm per method x length x rate, with the rate the link achieved."""
    cells = ttft_cells(ttft)
    rows = [[m, length, key, "" if c["achieved"] is None else round(c["achieved"], 3),
             f"{c['cold']:.1f} [{c['cold_range'][0]:.1f}, {c['cold_range'][1]:.1f}]",
             "" if m == REFERENCE else f"{c['warm']:.1f} [{c['warm_range'][0]:.1f}, {c['warm_range'][1]:.1f}]",
             round(c["bytes_per_token"] or 0.0, 1), "" if c["agrees"] is None else c["agrees"], c["n"]]
            for (m, length, key), c in cells.items()]
    return Table(f"[{label}] Time to first token, ms (median [min, max] of the repeats) per method, length and link",
                 ["method", "length", "set Gbit/s", "achieved Gbit/s", "cold", "warm", "B/token",
                  "first token = oracle's", "repeats"], rows,
                 note="cold = producer prefill + encode + wire + consumer decode + first token; warm = the payload "
                      "already in the store; oracle = the consumer's own prefill + first token (no link)")
