"""The test-seed ledger: which test seeds each method has been scored on, kept in the repository.

The measurement protocol (``docs/lab.md``) says a method, hyperparameter or target chosen after a test
seed was scored needs a fresh test seed for its headline. Memory cannot enforce that; this file can.
``models/seeds_used.json`` maps each method to the runs that scored it::

    {"format": "kvstate-seeds/1", "methods": {"semantic:sekv": [
        {"seed": 1000, "file": "models/ref-attn-sekv/eval.json", "commit": "1f6cc6c102c0",
         "date": "2026-12-02 00:17:06", "digest": "3be0c1a2d4e5f607"}, ...]}}

:func:`record_run` is called by the one function that appends a run to a result file
(:func:`kvstate.lab.provenance.append_run`); for a file under ``models/`` it

- refuses a run that names no seed or a dev seed (``< 1000``, :func:`kvstate.lab.protocol.check_reported_seed`);
- refuses a test seed the ledger already holds for one of the run's methods, unless some entry for that
  seed has the run's *method digest*: the same method re-scored unchanged (a rerun, more items) is allowed;
- otherwise appends one entry per (method, seed) and writes the ledger atomically, before the result.

**A method** is ``AXIS:NAME`` for each name the run lists (``provenance["methods"]`` or
``settings["methods"]``; the axis is the first source path the run names), else the result file itself
(``ref-attn-rcla/depth_eval``: the model is the method). **Its digest** covers what makes it that method: the
digest of the source the run names as its own (``code``), of every model / router / codec it read, and its
tasks, lengths and settings (``threads`` and the list of methods excepted). A retrained model, an edited
method, a new hyperparameter or a different task list is a different method; a fresh test seed is the fix.

Each refusal is one line naming the ledger entry and a fresh seed (the first test seed no entry of the
run's methods uses). :func:`ledger_from_results` rebuilds the ledger from the committed result files.
Ignored: concurrent writers (two runs appending at once may lose one ledger entry), a result written to a
file outside ``models/`` (not a result the report reads), and renaming a method to escape its entries.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvstate.errors import InputFileError, KVStateError
from kvstate.io_safety import write_text_atomic
from kvstate.lab import protocol
from kvstate.lab.results_file import FORMAT as RESULTS_FORMAT
from kvstate.lab.results_file import REPO, read_runs

FORMAT = "kvstate-seeds/1"
LEDGER_NAME = "seeds_used.json"
NOT_METHOD = {"threads", "methods"}  # settings that do not change what a method is


class SeedRefused(KVStateError):
    """A run may not be written into a result file under ``models/`` with these seeds."""


@dataclass(frozen=True)
class Entry:
    seed: int  # the test seed scored
    file: str  # the result file the run went into (repository-relative)
    commit: str  # the run's commit
    date: str  # the run's start (UTC)
    digest: str  # method digest (method_digest): equal digests are the same, unchanged method


Ledger = dict[str, list[Entry]]


def results_root() -> Path:
    """The directory whose result files the ledger guards: ``models/`` of the repository."""
    return REPO / "models"


def _relative(path: Path) -> str:
    p = path.resolve()
    try:
        return p.relative_to(REPO.resolve()).as_posix()
    except ValueError:
        return str(p)


def read_ledger(path: Path) -> Ledger:
    """The ledger at ``path`` (empty when the file does not exist); a malformed file is refused."""
    if not path.is_file():
        return {}
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("methods"), dict):
            raise ValueError(f"expected {{'format': {FORMAT!r}, 'methods': {{...}}}}")
        return {str(m): [Entry(int(e["seed"]), str(e["file"]), str(e["commit"]), str(e["date"]), str(e["digest"]))
                         for e in entries] for m, entries in doc["methods"].items()}
    except (ValueError, KeyError, TypeError) as e:
        raise InputFileError(f"{path}: not a seed ledger ({e}); restore it from git (git checkout -- {path})") from None


def write_ledger(path: Path, ledger: Mapping[str, Sequence[Entry]]) -> None:
    """Write the ledger atomically, methods sorted, entries in the order they were scored."""
    doc = {"format": FORMAT,
           "about": "test seeds each method was scored on (kvstate.lab.ledger); a used seed takes only the same "
                    "unchanged method (equal digest)",
           "methods": {m: [asdict(e) for e in ledger[m]] for m in sorted(ledger)}}
    write_text_atomic(path, json.dumps(doc, indent=1) + "\n")


def method_digest(provenance: Mapping[str, Any]) -> str:
    """What makes a run's method that method: its code digest, the models it read, tasks, lengths, settings."""
    settings = provenance.get("settings") or {}
    ident = {
        "code": (provenance.get("code") or {}).get("digest"),
        "models": provenance.get("models") or {},
        "tasks": provenance.get("tasks") or [],
        "lengths": provenance.get("lengths") or [],
        "settings": {k: v for k, v in settings.items() if k not in NOT_METHOD} if isinstance(settings, dict) else {},
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:16]


def method_names(path: Path, provenance: Mapping[str, Any], root: Path) -> list[str]:
    """The methods a run scores: ``AXIS:NAME`` for each listed method, else the result file (``dir/stem``)."""
    settings = provenance.get("settings") or {}
    listed = provenance.get("methods") or (settings.get("methods") if isinstance(settings, dict) else None)
    if isinstance(listed, list) and listed and all(isinstance(m, str) for m in listed):
        modules = (provenance.get("code") or {}).get("modules") or ["lab"]
        axis = str(modules[0]).split("/")[0]
        return [f"{axis}:{m}" for m in dict.fromkeys(listed)]
    rel = path.resolve().relative_to(root.resolve())
    return [rel.with_suffix("").as_posix()]


def fresh_seed(ledger: Mapping[str, Sequence[Entry]], methods: Iterable[str]) -> int:
    """The first test seed no entry of ``methods`` uses."""
    used = {e.seed for m in methods for e in ledger.get(m, ())}
    seed = protocol.TEST_SEED_MIN
    while seed in used:
        seed += 1
    return seed


def _seeds(provenance: Mapping[str, Any]) -> list[int]:
    seeds = provenance.get("seeds")
    if not isinstance(seeds, list) or not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds):
        return []
    return list(dict.fromkeys(seeds))


def check_run(path: Path, provenance: Mapping[str, Any], ledger: Mapping[str, Sequence[Entry]], root: Path,
              ledger_path: Path) -> list[tuple[str, int]]:
    """Refuse (:class:`SeedRefused`) or return the (method, seed) pairs the run adds to the ledger."""
    rel = _relative(path)
    methods = method_names(path, provenance, root)
    fresh = fresh_seed(ledger, methods)
    seeds = _seeds(provenance)
    if not seeds:
        raise SeedRefused(f"{rel}: the run names no seed; a result under models/ takes a test seed: pick a fresh "
                          f"test seed, e.g. --seed {fresh}")
    for seed in seeds:
        try:
            protocol.check_reported_seed(seed, fresh=fresh)
        except KVStateError as err:
            raise SeedRefused(f"{rel}: {err}") from None
    digest = method_digest(provenance)
    for method in methods:
        for seed in seeds:
            used = [e for e in ledger.get(method, ()) if e.seed == seed]
            if used and not any(e.digest == digest for e in used):
                e = used[-1]
                raise SeedRefused(
                    f"{rel}: test seed {seed} is already in {_relative(ledger_path)} for {method} ({e.file}, commit "
                    f"{e.commit}, {e.date}, digest {e.digest}) and this run's method differs (digest {digest}: its "
                    f"code, models, tasks or settings changed); pick a fresh test seed, e.g. --seed {fresh}")
    return [(m, s) for m in methods for s in seeds]


def record_run(path: str | Path, provenance: Mapping[str, Any], *, root: Path | None = None,
               ledger_path: Path | None = None) -> bool:
    """Check a run about to be appended to ``path`` against the ledger and record it; ``False`` when the file
    is outside ``root`` (default ``models/``) and nothing was checked. Raises :class:`SeedRefused`."""
    root = results_root() if root is None else root
    ledger_path = root / LEDGER_NAME if ledger_path is None else ledger_path
    p = Path(path).resolve()
    if not p.is_relative_to(root.resolve()):
        return False
    ledger = read_ledger(ledger_path)
    pairs = check_run(p, provenance, ledger, root, ledger_path)
    entry = dict(file=_relative(p), commit=str(provenance.get("commit") or "unknown"),
                 date=str(provenance.get("date_utc") or ""), digest=method_digest(provenance))
    for method, seed in pairs:
        ledger.setdefault(method, []).append(Entry(seed=seed, **entry))
    write_ledger(ledger_path, ledger)
    return True


def result_files(root: Path) -> list[Path]:
    """Every result file (``kvstate-results/1``) under ``root``."""
    out = []
    for f in sorted(root.rglob("*.json")):
        try:
            doc = json.loads(f.read_text(encoding="utf-8"))
        except (ValueError, OSError):
            continue
        if isinstance(doc, dict) and doc.get("format") == RESULTS_FORMAT:
            out.append(f)
    return out


_SEED_OPTION = re.compile(r"--seed[ =](\d+)")


def ledger_from_results(root: Path, files: Iterable[Path]) -> tuple[Ledger, list[str]]:
    """The ledger the committed result ``files`` under ``root`` imply, and one line per run left out of it.

    Every run with provenance and test seeds gives one entry per (method, seed), in file and run order; a run
    on dev seeds only, without seeds or without provenance is left out (said why), since the ledger holds
    test seeds. History is recorded as it is: a seed scored by two versions of a method keeps both digests.
    """
    ledger: Ledger = {}
    skipped: list[str] = []
    for f in sorted(files):
        for i, run in enumerate(read_runs(f)):
            prov = run.get("provenance")
            where = f"{_relative(f)} run {i + 1}"
            if not isinstance(prov, dict):
                seeds = sorted({int(s) for s in _SEED_OPTION.findall(str(run.get("command") or ""))})
                skipped.append(f"{where}: no provenance (seeds {seeds or 'unrecorded'}); not a ledger entry")
                continue
            seeds = _seeds(prov)
            tests = [s for s in seeds if protocol.is_test_seed(s)]
            if not tests:
                skipped.append(f"{where}: seeds {seeds} hold no test seed; not a ledger entry")
                continue
            digest = method_digest(prov)
            for method in method_names(f, prov, root):
                for seed in tests:
                    ledger.setdefault(method, []).append(Entry(seed, _relative(f), str(prov.get("commit") or "unknown"),
                                                               str(prov.get("date_utc") or ""), digest))
    return ledger, skipped


__all__ = ["FORMAT", "LEDGER_NAME", "Entry", "Ledger", "SeedRefused", "check_run", "fresh_seed",
           "ledger_from_results", "method_digest", "method_names", "read_ledger", "record_run", "result_files", "results_root",
           "write_ledger"]
