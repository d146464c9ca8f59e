"""Rebuild the test-seed ledger (``models/seeds_used.json``) from the committed result files.

Run: ``.venv/bin/python scripts/seed_ledger.py [--overwrite]``. Reads every ``kvstate-results/1`` file under
``models/`` and writes one entry per (method, test seed) run (:func:`kvstate.lab.ledger.ledger_from_results`);
prints a methods x seeds table and the runs left out (dev seeds, no seed, no provenance) on stderr. An
existing ledger is replaced only with ``--overwrite``: it also holds entries of runs appended since.
"""

from __future__ import annotations

import argparse
import sys

from kvstate.lab import ledger as L


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--overwrite", action="store_true", help="replace an existing ledger")
    args = ap.parse_args()
    root = L.results_root()
    path = root / L.LEDGER_NAME
    if path.exists() and not args.overwrite:
        print(f"{path} exists; pass --overwrite to rebuild it from the result files", file=sys.stderr)
        return 2
    ledger, skipped = L.ledger_from_results(root, L.result_files(root))
    L.write_ledger(path, ledger)
    for method in sorted(ledger):
        seeds = sorted({e.seed for e in ledger[method]})
        files = sorted({e.file for e in ledger[method]})
        digests = len({(e.seed, e.digest) for e in ledger[method]})
        print(f"{method:40s} seeds {seeds}  runs {len(ledger[method])}  seed-digests {digests}  {', '.join(files)}",
              file=sys.stderr)
    for line in skipped:
        print(f"left out: {line}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
