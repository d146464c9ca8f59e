"""Exact-planner A/B: ``plan_checkpoints(method="optimal")`` of the working tree against the placement and
envelope modules of a git revision, at N = 131072, M = 64 on the shapes of ``prefix_planner.py``.

Both codes run in interleaved rounds (one call each per round, so load drifts hit both alike); the plans
must be identical. Prints a table (medians and minima), then one JSON line.

    python benchmarks/prefix_planner_ab.py --rev main --rounds 41 --align 64
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

from kvstate.prefix import placement
from prefix_planner import M_BIG, N_BIG, shapes

MODULES = ("envelope", "placement")  # placement imports envelope: both come from the revision


def load_revision(rev: str, where: Path) -> ModuleType:
    """The revision's placement module, importing the revision's envelope module."""
    mods: dict[str, ModuleType] = {}
    for name in MODULES:
        src = subprocess.run(
            ["git", "show", f"{rev}:src/kvstate/prefix/{name}.py"], capture_output=True, text=True, check=True
        ).stdout
        path = where / f"{name}.py"
        path.write_text(src)
        spec = importlib.util.spec_from_file_location(f"ab_{name}", path)
        assert spec is not None and spec.loader is not None
        mods[name] = importlib.util.module_from_spec(spec)
        saved = sys.modules.get("kvstate.prefix.envelope")
        if name == "placement":
            sys.modules["kvstate.prefix.envelope"] = mods["envelope"]
        try:
            spec.loader.exec_module(mods[name])
        finally:
            if saved is not None:
                sys.modules["kvstate.prefix.envelope"] = saved
    return mods["placement"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", default="main", help="git revision to compare against (default main)")
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--align", type=int, default=64)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        old = load_revision(a.rev, Path(tmp))
    codes = {a.rev: old, "worktree": placement}
    result: dict[str, dict[str, float]] = {}
    for name, w in shapes(N_BIG).items():
        plans = {k: m.plan_checkpoints(w, M_BIG, "optimal", align=a.align) for k, m in codes.items()}
        if plans[a.rev] != plans["worktree"]:
            print(f"{name}: plans differ", file=sys.stderr)
            return 1
        times: dict[str, list[float]] = {k: [] for k in codes}
        for _ in range(a.rounds):
            for k, m in codes.items():
                t0 = time.perf_counter()
                m.plan_checkpoints(w, M_BIG, "optimal", align=a.align)
                times[k].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) for k, v in times.items()}
        result[name] = {"before_ms": med[a.rev] * 1e3, "after_ms": med["worktree"] * 1e3}
        print(
            f"{name:10s} align={a.align}  {a.rev} {med[a.rev] * 1e3:7.1f} ms (min {min(times[a.rev]) * 1e3:6.1f})"
            f"  worktree {med['worktree'] * 1e3:7.1f} ms (min {min(times['worktree']) * 1e3:6.1f})"
            f"  x{med[a.rev] / med['worktree']:.2f}  plans identical",
            file=sys.stderr,
        )
    print(
        json.dumps(
            {
                "rev": a.rev,
                "rounds": a.rounds,
                "align": a.align,
                "n": N_BIG,
                "slots": M_BIG,
                "shapes": result,
            },
            sort_keys=True,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
