"""The docs pass of the report: rebuild the report, then refresh every results table marked in ``docs/``.

Issue 42's rule — numbers in ``docs/`` are generated, so a superseded run cannot stay quoted — as a command:
the report's sections are built (:func:`kvstate.lab.make.build.build_report`, the same page ``kvstate report``
writes) and each ``<!-- kvstate:table SECTION "TITLE START" -->`` block in ``docs/*.md`` is replaced by that
table (:mod:`kvstate.lab.report.docs`). ``--check`` changes nothing and exits 1 when a page would change.

Run: ``python -m kvstate.lab.make.docs [--out report] [--models models] [--docs docs] [--check]`` (``make docs``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvstate.errors import KVStateError


def main(argv: list[str] | None = None) -> int:
    """Build the report into ``--out`` and refresh the marked tables of ``--docs``; 2 on bad input."""
    from kvstate.lab.make.build import build_report
    from kvstate.lab.report import docs
    from kvstate.lab.report.html import Section

    ap = argparse.ArgumentParser(prog="python -m kvstate.lab.make.docs", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("report"), help="the report directory (rebuilt)")
    ap.add_argument("--models", type=Path, default=Path("models"))
    ap.add_argument("--docs", type=Path, default=Path("docs"), help="the Markdown pages to refresh")
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 when a page is out of date")
    args = ap.parse_args(argv)
    pages = sorted(args.docs.glob("*.md"))
    try:
        if not pages:
            raise KVStateError(f"--docs {args.docs}: no Markdown pages there; pass the docs directory")
        sections: list[Section] = []
        build_report(args.out, args.models, collect=sections)
        if args.check:
            stale = [p for p in pages if docs.fill(p.read_text(encoding="utf-8"), sections) != p.read_text(
                encoding="utf-8")]
            for p in stale:
                print(f"{p}: a marked table differs from the report; run `make docs`", file=sys.stderr)
            return 1 if stale else 0
        changed = docs.update(pages, sections)
    except KVStateError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"docs: {len(changed)} of {len(pages)} pages refreshed ({', '.join(map(str, changed)) or 'none changed'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
