"""Issue 42, item 2 (one writer): result files are written by the experiment loop (``kvstate.lab.experiment``) and
nothing else. The writers that predate the rule are listed here by file with their number of calls; each moves
onto the loop with its next re-run (moving it edits a file its committed results executed, which marks them
stale). A new writer anywhere else, or one more call in a listed file, fails this test."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "kvstate"
WRITERS = ("append_run", "write_results", "Recorder")
HOME = {"lab/experiment.py", "lab/provenance.py", "lab/cli_output.py"}  # the loop and the layer under it
# writers outside the loop, frozen: file -> calls of append_run / write_results / Recorder (may only shrink)
LEGACY = {
    "lab/depth/cli.py": 6, "lab/depth/evaluate.py": 1, "lab/semantic/cli.py": 1, "lab/semantic/memory_floor.py": 2,
    "lab/semantic/route_probe.py": 2, "lab/semantic/timing.py": 2, "lab/prefix/bench.py": 2, "lab/models/cli.py": 2,
    "lab/models/serve_peer.py": 1, "lab/models/exchange.py": 1, "lab/serving/common.py": 1, "lab/transfer/cli.py": 4,
    "lab/transfer/pilot_options_timing.py": 2, "lab/transfer/pilot_options.py": 2,
}


def writer_calls(source: str) -> int:
    """Calls of a result writer in ``source`` (``append_run(…)``, ``x.write_results(…)``, ``Recorder(…)``)."""
    n = 0
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            n += name in WRITERS
    return n


def test_the_scanner_finds_each_writer_form() -> None:
    src = "append_run(p, r, q)\nprov.write_results(o, r, p)\nrec = Recorder(code=())\nwrite_text(p, s)\n"
    assert writer_calls(src) == 3 and writer_calls("def append_run(p):\n    return p\n") == 0


def test_no_result_writer_outside_the_loop_but_the_frozen_legacy_ones() -> None:
    found = {}
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel not in HOME and (n := writer_calls(path.read_text(encoding="utf-8"))):
            found[rel] = n
    new = {f: n for f, n in found.items() if n > LEGACY.get(f, 0)}
    assert new == {}, f"result writers outside the loop (write through kvstate.lab.experiment.run / run_items): {new}"
    gone = sorted(f for f in LEGACY if found.get(f, 0) < LEGACY[f])
    assert gone == [], f"these moved onto the loop: lower or remove their LEGACY entries {gone}"
