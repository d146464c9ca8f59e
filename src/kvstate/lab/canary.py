"""The canary: the project's exactness and integration subset on the newest transformers, beside the lock.

A transformers release can move an internal kvstate relies on (5.25 wrapped the Gated-DeltaNet kernels, and
a fresh install broke every hybrid model). ``make canary`` finds that before a user does: it compiles a
throwaway lock of ``.venv``'s inputs with the transformers pin lifted (the newest release the registry
serves; torch stays the local CPU wheel, the newest CPU build this machine can install), builds
``.venv-canary`` from it, runs :data:`SUBSET` there and in the locked ``.venv``, and appends both runs —
versions, per-test outcomes, and every test whose outcome differs with its one-line reason — to
``docs/results/compat.json``. :mod:`kvstate.models.compat` holds the internals themselves; its
``TESTED`` range and pyproject's bounds move only after a canary passes.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from kvstate.lab.locks import ENVS, REPO, compile_lock, install

RESULTS = REPO / "docs" / "results" / "compat.json"
# restore-then-continue exact on every family (aligned and unaligned cuts, fp32 and bf16), the internals
# themselves, generate from a restored cache, batched = alone, SEKV / transfer / depth on tiny configs, and
# the server's one-request path
SUBSET = (
    "tests/lib/models/test_compat.py",
    "tests/lib/models/test_models_state.py",
    "tests/lib/models/test_chunked_prefill.py",
    "tests/lib/prefix/test_generate_contract.py",
    "tests/lib/serve/test_batching.py::test_batched_greedy_equals_each_request_alone",
    "tests/lib/serve/test_batching.py::test_cache_of_continues_like_the_lone_cache",
    "tests/lib/semantic/test_semantic_cache.py",
    "tests/lib/transfer/test_transfer_methods.py::test_lossless_methods_equal_the_oracle_for_one_model",
    "tests/lib/depth/test_depth_sharing.py::test_prefill_and_decode_through_the_sharing_cache_equal_full_recompute",
    "tests/lib/depth/test_depth_sharing.py::test_generate_works_under_every_preset_and_matches_recompute",
    "tests/lib/serve/test_server.py::test_completion_equals_a_plain_greedy_decode",
)


def commit() -> str:
    """The commit the subset ran at (``+dirty`` when the work tree differs from it)."""
    head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
                           text=True)
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def versions(python: Path) -> dict[str, str]:
    code = ("import json, sys, torch, transformers; print(json.dumps({'transformers': transformers.__version__, "
            "'torch': torch.__version__, 'python': sys.version.split()[0]}))")
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])  # type: ignore[no-any-return]


def run_subset(python: Path, tests: tuple[str, ...] = SUBSET) -> dict[str, dict[str, str]]:
    """``{test id: {"outcome": passed|failed|error|skipped, "reason": first line}}`` of ``tests`` under
    ``python`` (one pytest process, CI's hypothesis profile, one thread)."""
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        env = {**os.environ, "CI": "true", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        cmd = [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *tests]
        done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        if not junit.is_file():
            raise RuntimeError(f"pytest under {python} wrote no report: {(done.stderr or done.stdout)[-800:]}")
        return parse_junit(junit.read_text())


def parse_junit(text: str) -> dict[str, dict[str, str]]:
    results: dict[str, dict[str, str]] = {}
    for case in ET.fromstring(text).iter("testcase"):
        name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        outcome, reason = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                reason = " ".join((node.get("message") or node.text or "").split())[:300]
                break
        results[name] = {"outcome": outcome, "reason": reason}
    return results


def summary(results: dict[str, dict[str, str]]) -> dict[str, int]:
    counts = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    for r in results.values():
        counts[r["outcome"]] += 1
    return counts


def differences(locked: dict[str, dict[str, str]], newest: dict[str, dict[str, str]]) -> list[dict[str, str]]:
    """Each test whose outcome differs between the two runs, with the newest run's reason."""
    diff = []
    for name in sorted(set(locked) | set(newest)):
        a = locked.get(name, {"outcome": "absent", "reason": ""})
        b = newest.get(name, {"outcome": "absent", "reason": ""})
        if a["outcome"] != b["outcome"]:
            diff.append({"test": name, "lock": a["outcome"], "newest": b["outcome"], "reason": b["reason"] or a["reason"]})
    return diff


def append(record: dict[str, Any], path: Path = RESULTS) -> None:
    """Append ``record`` to ``path``'s ``runs`` (written aside, moved whole)."""
    doc: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {
        "what": "make canary: the exactness and integration subset on the locked environment and on the newest "
                "transformers the registry serves (kvstate.lab.canary)", "runs": []}
    doc["runs"].append(record)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="make canary", description=__doc__.split("\n\n")[0])
    ap.add_argument("--transformers", default="transformers",
                    help="the release to try (a requirement; default: the newest the registry serves)")
    ap.add_argument("--venv", default=str(REPO / ".venv-canary"))
    ap.add_argument("--no-record", action="store_true", help="print the record, do not append it")
    args = ap.parse_args(argv)
    main_env = ENVS["main"]
    venv = Path(args.venv)
    venv.mkdir(parents=True, exist_ok=True)
    lock = venv.parent / f"{venv.name}.lock.txt"
    print(f"canary: compiling {args.transformers} beside {main_env.inputs.name}'s other pins", flush=True)
    compile_lock(main_env, out=lock, extra=[args.transformers], drop=("transformers",))
    print(f"canary: building {venv} from {lock.name}", flush=True)
    newest_py = install(main_env, fresh=True, venv=venv, lock=lock)
    lock_py = Path(sys.executable)
    record: dict[str, Any] = {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                              "commit": commit(), "command": "make canary", "subset": list(SUBSET)}
    runs = {}
    for label, py in (("lock", lock_py), ("newest", newest_py)):
        print(f"canary: running the subset under {label} ({py})", flush=True)
        results = run_subset(py)
        runs[label] = results
        record[label] = {"versions": versions(py), "summary": summary(results), "tests": results}
        print(f"canary: {label} {record[label]['versions']} {record[label]['summary']}", flush=True)
    record["differences"] = differences(runs["lock"], runs["newest"])
    record["passed"] = all(summary(r)["failed"] + summary(r)["error"] == 0 for r in runs.values())
    lock.unlink(missing_ok=True)
    if args.no_record:
        print(json.dumps(record, indent=1))
    else:
        append(record)
        print(f"canary: appended to {RESULTS.relative_to(REPO)}", flush=True)
    for d in record["differences"]:
        print(f"  differs: {d['test']}: lock {d['lock']}, newest {d['newest']}: {d['reason']}")
    print(f"canary: {'passed' if record['passed'] else 'FAILED'} on transformers "
          f"{record['newest']['versions']['transformers']}")
    return 0 if record["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
