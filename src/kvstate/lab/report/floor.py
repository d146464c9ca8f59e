"""The class floor: a pooled score never hides a task class that collapsed.

A quality score pools the (task, length) cells the reference solves (:func:`kvstate.lab.protocol.solved_tasks`);
a method can pass a pooled target while failing a class the reference does well on but does not solve (the
shifted pair's selective recompute: 0.98x the oracle pooled, 0.255 vs 0.70 on niah_multiquery at 1K). So beside
every pooled score a section shows the method per class — every class the reference scores >= ``FLOOR_AT`` on —
with the ratio to the reference, and one headline row per section: *no such class falls below ``FLOOR`` x the
reference*. Each class is decided by the method's own 95% interval on it (:func:`kvstate.lab.stats.rate`) against
``FLOOR`` x the reference's score there (:func:`kvstate.lab.stats.decide`): missed when the whole interval lies
below, met when it lies at or above, undecided when it straddles. (A paired interval of ``method - FLOOR x
reference`` would also carry the reference's noise, but for a class both solve on every item the difference is a
constant 0.1 whose no-spread interval is wide enough to leave the class undecided.) The row is missed when any
class is, met when every class is, else undecided (:func:`kvstate.lab.protocol.combine_status`); a missed row names
the classes that fell.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvstate.lab import protocol, stats
from kvstate.lab.report.html import HeadlineRow, Table, artifact_row

FLOOR_AT = 0.5  # classes the reference scores at least this on are held to the floor
FLOOR = 0.9  # no such class below this x the reference
TARGET = (f"no task class the reference scores >= {FLOOR_AT:g} on falls below {FLOOR:g}x the reference "
          "(the method's interval per class)")


@dataclass(frozen=True)
class ClassScore:
    """One method on one task class, against the reference on the same class."""

    group: str  # what is held to the floor, e.g. "[shifted] selective recompute"
    cls: str  # the class, e.g. "niah_multiquery@1024"
    reference: str  # the reference's name, e.g. "oracle"
    ref_score: float  # the reference's mean on the class
    score: stats.Estimate | None  # the method's mean with its interval (None: no per-item scores)
    diff: stats.Estimate | None  # the method's score and interval minus FLOOR x the reference's score
    status: stats.Status  # met | missed | undecided

    @property
    def ratio(self) -> float | None:
        return None if self.score is None or not self.ref_score else self.score.value / self.ref_score

    def short(self) -> str:
        ratio = "" if self.ratio is None else f" ({self.ratio:.2f}x)"
        mine = "no per-item scores" if self.score is None else f"{self.score.value:.3f}"
        return f"{self.group} {self.cls} {mine} vs {self.reference} {self.ref_score:.3f}{ratio}"


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if len(xs) else 0.0


def class_scores(group: str, method: Mapping[str, Sequence[float]], reference: Mapping[str, Sequence[float]],
                 reference_name: str = "reference", *, at: float = FLOOR_AT,
                 floor: float = FLOOR) -> list[ClassScore]:
    """``method`` and ``reference``: class -> per-item scores in [0, 1]. One :class:`ClassScore` per class the
    reference scores ``>= at`` on (in the reference's order)."""
    out: list[ClassScore] = []
    for cls, ref in reference.items():
        ref = [float(x) for x in ref]
        if not ref or _mean(ref) < at:
            continue
        mine = [float(x) for x in method.get(cls) or []]
        if not mine:
            out.append(ClassScore(group, cls, reference_name, _mean(ref), None, None, "undecided"))
            continue
        est = stats.rate(mine)
        bar = floor * _mean(ref)  # the class's floor: FLOOR x the reference's score there
        diff = stats.Estimate(est.value - bar, est.lo - bar, est.hi - bar, est.n)
        out.append(ClassScore(group, cls, reference_name, _mean(ref), est, diff, stats.decide(est.lo, est.hi, bar)))
    return out


def floor_status(scores: Sequence[ClassScore]) -> stats.Status:
    return protocol.combine_status([s.status for s in scores]) if scores else "undecided"


def collapsed(scores: Sequence[ClassScore]) -> list[ClassScore]:
    """The classes decided below the floor."""
    return [s for s in scores if s.status == "missed"]


def collapse_note(scores: Sequence[ClassScore], floor: float = FLOOR) -> str:
    """A suffix for a pooled row whose method fell below the floor on a class ("" when none did)."""
    fell = collapsed(scores)
    if not fell:
        return ""
    return f"; below {floor:g}x the {fell[0].reference} on " + ", ".join(
        f"{s.cls} ({s.score.value:.3f} vs {s.ref_score:.3f})" for s in fell if s.score is not None)


def floor_row(art: Any, technique: str, scores: Sequence[ClassScore], *, floor: float = FLOOR,
              target: str = TARGET, no_items: bool = False, **about: Any) -> HeadlineRow:
    """The section's class-floor row over every (group, class) in ``scores``, from the file ``art``;
    ``no_items``: the file keeps no per-class items (undecided, naming the command that writes them)."""
    if no_items:
        return artifact_row(art, technique, target, "not decided: no per-class items in the committed file; rerun "
                            f"with `{art.command}`", status="undecided", **about)
    if not scores:
        return artifact_row(art, technique, target, f"no task class the reference scores >= {FLOOR_AT:g} on: "
                            "nothing to hold to the floor", status="undecided", **about)
    status = floor_status(scores)
    decided = [s for s in scores if s.diff is not None]
    if status == "missed":
        fell = collapsed(scores)
        worst = min(fell, key=lambda s: s.diff.hi if s.diff else 0.0)
        shown = (f"missed on {len(fell)} of {len(scores)} classes — below {floor:g}x: "
                 + "; ".join(s.short() for s in fell))
    else:
        worst = min(decided, key=lambda s: s.diff.lo if s.diff else 0.0) if decided else scores[0]
        open_ = [s for s in scores if s.status == "undecided"]
        shown = (f"{len(scores) - len(open_)} of {len(scores)} classes at or above {floor:g}x; closest: "
                 f"{worst.short()}" + (f"; straddling: {', '.join(f'{s.group} {s.cls}' for s in open_)}"
                                       if open_ else ""))
    d = worst.diff
    ci = None if d is None else (d.lo, d.hi)
    if d is not None:
        shown += f" (that class: method - {floor:g}x reference {d.value:+.3f} [{d.lo:+.3f}, {d.hi:+.3f}], n = {d.n})"
    return artifact_row(art, technique, target, shown, status=status, ci=ci, rate=ci is not None, **about)


def floor_table(scores: Sequence[ClassScore], title: str, pooled: Mapping[str, str] | None = None,
                floor: float = FLOOR) -> Table:
    """Per task class beside the pooled score: the method, the reference, their ratio and the floor's decision."""
    rows: list[list[Any]] = []
    for s in scores:
        score = "—" if s.score is None else f"{s.score.value:.3f} [{s.score.lo:.3f}, {s.score.hi:.3f}]"
        diff = "—" if s.diff is None else f"{s.diff.value:+.3f} [{s.diff.lo:+.3f}, {s.diff.hi:+.3f}]"
        rows.append([s.group, s.cls, "" if s.score is None else s.score.n, score, f"{s.ref_score:.3f}",
                     "—" if s.ratio is None else f"{s.ratio:.2f}x", diff, s.status])
    for group, text in (pooled or {}).items():
        rows.append([group, "pooled (solved cells)", "", text, "", "", "", ""])
    return Table(title, ["method", "task class", "n", "score [95%]", "reference", "ratio",
                         f"method - {floor:g}x reference [95%]", "floor"], rows,
                 f"Every class the reference scores >= {FLOOR_AT:g} on; a class is below the floor when the method's "
                 f"whole interval lies below {floor:g}x the reference's score there.")


__all__ = ["FLOOR", "FLOOR_AT", "TARGET", "ClassScore", "class_scores", "collapse_note", "collapsed", "floor_row",
           "floor_status", "floor_table"]
