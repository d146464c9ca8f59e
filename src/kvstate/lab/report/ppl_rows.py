"""Held-out perplexity rows for the report's real-model sections: a run's appendix rows (pooled perplexity, the
paired ratio to its reference, the decision against a limit registered before the run) as table cells and headline
rows. The runs: :mod:`kvstate.lab.transfer.realpair_ppl` (across models) and
:mod:`kvstate.lab.semantic.realmodel8_ppl` (resolution); the paired ratio is
:func:`kvstate.lab.stats.paired_perplexity_ratio`."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from kvstate.lab.provenance import Artifact
from kvstate.lab.report.html import HeadlineRow, artifact_row


@dataclass(frozen=True)
class PplRow:
    """One method's appendix row with its common cells."""

    row: dict[str, Any]  # the appendix row as the run wrote it
    perplexity: str  # "ppl [lo, hi]"
    ratio: str  # "ratio x [lo, hi]" ("1": the reference)
    score: dict[str, Any] | None  # the loop's row for the method (its per-window score, interval), if any

    @property
    def method(self) -> str:
        return str(self.row["method"])


def seeds(art: Artifact) -> str:
    """The run's seeds, comma-separated."""
    return ", ".join(str(s) for s in ((art.run or {}).get("experiment") or {}).get("seeds", []))


def ppl_rows(art: Artifact) -> Iterator[PplRow]:
    """The appendix rows of ``art``'s run, in its order."""
    run = art.run or {}
    scores = {r["method"]: r for r in run.get("rows") or []}
    for r in (run.get("appendix") or {}).get("rows") or []:
        ratio = f"{r['ratio']:.3f}x [{r['ratio_ci'][0]:.3f}, {r['ratio_ci'][1]:.3f}]" if "ratio" in r else "1"
        yield PplRow(r, f"{r['ppl']:.3f} [{r['ci'][0]:.3f}, {r['ci'][1]:.3f}]", ratio, scores.get(r["method"]))


def headline(art: Artifact, where: str, p: PplRow, what: str) -> HeadlineRow | None:
    """The row's decision as a headline row (None: a row the run did not decide — the reference, a floor)."""
    r = p.row
    if "status" not in r:
        return None
    exp = (art.run or {}).get("experiment") or {}
    return artifact_row(art, where, f"{r['method']}: held-out perplexity{what} {r['target']}", p.ratio,
                        status=r["status"], n=r["windows"], seeds=exp.get("seeds"), ci=tuple(r["ratio_ci"]))


__all__ = ["PplRow", "headline", "ppl_rows", "seeds"]
