"""NVIDIA kvpress presses as baselines, run in an isolated virtual environment.

kvpress 0.5.5 pins ``transformers<5.3`` and patches transformers' attention globally when imported,
so it never enters this process: :func:`ensure_env` builds ``.venv-kvpress`` from its lock
(``locks/kvpress.txt``: torch 2.13.0+cpu, kvpress 0.5.5, transformers 5.2.0, every package hashed; see
:mod:`kvstate.lab.locks`), which loads the committed reference models unchanged, :func:`run_presses` writes the items to JSONL, runs
``kvstate/lab/semantic/kvpress_runner.py`` with that interpreter on the same model directory and reads its
JSONL back into :class:`~kvstate.lab.semantic.bench.Outcome` rows (the registry's ``kvpress`` adapter,
:mod:`kvstate.lab.semantic.methods.kvpress`, is the one caller), with the byte counts the runner measured
in its own process. A press that could not run — one that needs files from a model hub (RestoreKV,
QFilter, KVzap, DuoAttention, FastKVzip, LUKV), one kvpress lacks, one that raised, or every press when
the environment cannot be created — is recorded as *not run* with the reason (:func:`not_run`), never
as a score of 0.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvstate.errors import KVStateError
from kvstate.lab.journal import Journal
from kvstate.lab.locks import ENVS, LockError, install
from kvstate.lab.semantic.protocol import Item, items_to_rows, read_jsonl, write_jsonl

DEFAULT_PRESSES = ("SnapKVPress", "StreamingLLMPress", "TOVAPress", "ExpectedAttentionPress", "KnormPress")
NOT_RUN = {name: "needs files from a model hub" for name in
           ("RestoreKVPress", "QFilterPress", "KVzapPress", "DuoAttentionPress", "FastKVzipPress", "LUKVPress")}
RUNNER = Path(__file__).with_name("kvpress_runner.py")


class KVPressEnvError(KVStateError):
    """The isolated kvpress environment could not be created or run."""


def snake(name: str) -> str:
    """kvpress class name → result method name: ``SnapKVPress`` → ``snap_kv_press``."""
    s = re.sub(r"(.)([A-Z][a-z]+)", r"\1_\2", name)
    return re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", s).lower()


def ensure_env(venv: Path, create: bool = True) -> Path:
    """The interpreter of a working kvpress environment at ``venv`` (created if missing and ``create``)."""
    py = venv / "bin" / "python"
    if not py.is_file():
        if not create:
            raise KVPressEnvError(f"no kvpress environment at {str(venv)!r}; create it from its lock with "
                                  "`python3 src/kvstate/lab/locks.py install kvpress` (or `make test`)")
        try:
            py = install(ENVS["kvpress"], venv=venv)
        except LockError as exc:
            raise KVPressEnvError(f"creating the kvpress environment failed: {exc}") from exc
    check = subprocess.run([str(py), "-c", "import kvpress, transformers; print(transformers.__version__)"],
                           capture_output=True, text=True)
    if check.returncode != 0:
        raise KVPressEnvError(f"the kvpress environment at {str(venv)!r} does not import kvpress: "
                              f"{check.stderr.strip()[-600:]}; delete it to recreate")
    return py


def not_run(presses: Sequence[str], budgets: Sequence[float], reason: str) -> list[dict[str, Any]]:
    """One "not run" entry per press and budget, with the reason."""
    return [{"method": snake(p), "budget": b, "reason": reason} for p in presses for b in budgets]


CHUNK = 20  # items per runner call: the unit a journal records


def _runner(python: Path, model_dir: Path, items: Sequence[Item], presses: Sequence[str], budgets: Sequence[float],
            workdir: Path, threads: int) -> list[dict[str, Any]]:
    """The runner's result rows for ``items`` (one subprocess, one model load)."""
    tasks, out = workdir / "kvpress_tasks.jsonl", workdir / "kvpress_results.jsonl"
    write_jsonl(tasks, items_to_rows(list(items)))
    cmd = [str(python), str(RUNNER), "--model", str(model_dir), "--tasks", str(tasks), "--out", str(out),
           "--presses", ",".join(presses), "--ratios", ",".join(str(round(1 - b, 6)) for b in budgets),
           "--threads", str(threads)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise KVPressEnvError(f"the kvpress runner failed: {done.stderr.strip()[-800:]}")
    return list(read_jsonl(out))


def run_presses(python: Path, model_dir: Path, items: Sequence[Item], presses: Sequence[str],
                budgets: Sequence[float], workdir: Path, threads: int = 1, journal: Journal | None = None,
                progress: Callable[[int], None] | None = None) -> tuple[list[Any], list[dict]]:
    """Run ``presses`` at ``compression_ratio = 1 - budget``; returns outcomes and "not run" entries (one per
    press and budget that raised for any item, with the first reason).

    Items go to the runner :data:`CHUNK` at a time; with a ``journal`` each chunk's rows are recorded and a
    chunk already there is read back instead of run again. ``progress(k)`` after each chunk of ``k`` items.
    """
    # imported here: the bench reaches the presses through the registry, which imports this module
    from kvstate.lab.semantic.bench import Outcome, score_prediction

    rows: list[dict[str, Any]] = []
    for c in range(0, len(items), CHUNK):
        part = list(items[c:c + CHUNK])
        unit = f"kvpress/{c}:{c + len(part)}"
        got = journal.get(unit) if journal is not None else None
        if got is None:
            got = _runner(python, model_dir, part, presses, budgets, workdir, threads)
            if journal is not None:
                journal.put(unit, got)
        rows += got
        if progress is not None:
            progress(len(part))
    by_key = {(it.task, it.length, it.index): it for it in items}
    outcomes, failed = [], {}
    for r in rows:
        budget = round(1 - r["ratio"], 6)
        if "error" in r:
            failed.setdefault((r["press"], budget), r["error"])
            continue
        it = by_key[(r["task"], r["length"], r["index"])]
        q = int(r["question"])
        outcomes.append(Outcome(snake(r["press"]), budget, it.task, it.length, it.index, q, it.depth,
                                score_prediction(it, q, r["prediction"]), r["prediction"], int(r["resident_bytes"]),
                                int(r["total_bytes"]), int(r["attended_bytes_peak"]), int(r["full_bytes"]),
                                float(r["read_ratio_peak"]), float(r["decode_s"]), int(r["decode_steps"]), None))
    outcomes = [o for o in outcomes if (_class(o.method, presses), o.budget) not in failed]  # all items or none
    return outcomes, [{"method": snake(p), "budget": b, "reason": why} for (p, b), why in failed.items()]


def _class(method: str, presses: Sequence[str]) -> str:
    return next((p for p in presses if snake(p) == method), method)


def versions(python: Path) -> dict[str, str]:
    code = "import json, kvpress, transformers, importlib.metadata as m; print(json.dumps({'kvpress': m.version('kvpress'), 'transformers': transformers.__version__}))"
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True)
    return json.loads(done.stdout) if done.returncode == 0 else {}
