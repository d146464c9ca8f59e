"""Shared figure helpers for report sections: one colour per method across every figure, annotated heatmaps.

``color(name)`` gives a method (or model) the same colour in every figure of the report: the names the
techniques use are fixed below; any other name gets a stable colour from its hash, so a new section's
methods are consistent without editing this file. ``heatmap`` draws a grid with every cell's value
written in it and a colour scale fitted to the values present (so 0.95 and 1.00 look different); when
every cell is equal it returns ``False`` and draws nothing: say it in a table or a sentence instead (``flat_panel``).
``save`` writes a figure at the page's width.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

# Okabe–Ito (colour-blind safe) first, then tab10's remaining hues.
_BASE = ["#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442", "#000000",
         "#8c564b", "#7f7f7f", "#bcbd22", "#17becf", "#9467bd"]

PALETTE: dict[str, str] = {
    # position: checkpoint placement methods (the exact DP is always blue)
    "optimal": "#0072B2", "balanced": "#E69F00", "block": "#D55E00", "log": "#CC79A7", "sqrt": "#009E73",
    "junction": "#7f7f7f",
    # full-cache references
    "full": "#000000", "full cache": "#000000", "ref-attn": "#56B4E9", "ref-hybrid": "#009E73",
}

DPI = 100
PAGE_WIDTH_IN = 10.5  # ~1050 px at DPI: the page's content width, so figures are shown at 1:1


def color(name: str) -> str:
    """The colour of a method or model in every figure of the report (stable for names not listed)."""
    if name in PALETTE:
        return PALETTE[name]
    return _BASE[zlib.crc32(name.encode()) % len(_BASE)]


def all_equal(values: Sequence[Sequence[float | None]]) -> bool:
    """True when every present (non-None, non-NaN) cell holds the same value (a heatmap would be one colour)."""
    flat = [v for row in values for v in row if v is not None and not math.isnan(v)]
    return len(set(flat)) <= 1


def heatmap(ax: Any, values: Sequence[Sequence[float | None]], xlabels: Sequence[str], ylabels: Sequence[str],
            xlabel: str, ylabel: str, fmt: Callable[[float], str] = lambda v: f"{v:.2f}",
            cbar_label: str = "", cmap: str = "viridis", vmin: float | None = None,
            vmax: float | None = None) -> bool:
    """Annotated heatmap (values written in each cell, blank where None); False and nothing drawn if all equal."""
    if all_equal(values):
        return False
    grid = [[math.nan if v is None else float(v) for v in row] for row in values]
    present = [v for row in grid for v in row if not math.isnan(v)]
    lo = min(present) if vmin is None else vmin
    hi = max(present) if vmax is None else vmax
    im = ax.imshow(grid, cmap=cmap, vmin=lo, vmax=hi, aspect="auto", origin="lower")
    ax.set_xticks(range(len(xlabels)), list(xlabels))
    ax.set_yticks(range(len(ylabels)), list(ylabels))
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    mid = (lo + hi) / 2
    for i, row in enumerate(grid):
        for j, v in enumerate(row):
            if not math.isnan(v):
                # viridis is dark at the low end: white text there, black above the middle
                ax.text(j, i, fmt(v), ha="center", va="center", fontsize=9, color="white" if v < mid else "black")
    bar = ax.figure.colorbar(im, ax=ax)
    if cbar_label:
        bar.set_label(cbar_label)
    return True


def flat_panel(ax: Any, text: str) -> None:
    """A panel whose grid is one value: no axes, just the sentence (a one-colour heatmap says nothing)."""
    ax.axis("off")
    ax.text(0.5, 0.5, text, ha="center", va="center", fontsize=11, wrap=True, transform=ax.transAxes)


def figure(width_frac: float = 1.0, height_in: float = 3.8, ncols: int = 1, **kw: Any) -> tuple[Any, Any]:
    """A figure ``width_frac`` of the page wide (so text stays readable at the page's width)."""
    return plt.subplots(1, ncols, figsize=(PAGE_WIDTH_IN * width_frac, height_in), squeeze=False, **kw)


def save(fig: Any, out_dir: Path, name: str) -> str:
    """Write ``fig`` as ``out_dir/name`` (PNG), close it, return the bare file name for a :class:`Figure`."""
    fig.tight_layout()
    fig.savefig(out_dir / name, dpi=DPI)
    plt.close(fig)
    return name
