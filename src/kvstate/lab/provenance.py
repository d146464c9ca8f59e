"""Where every result file came from, and whether it still describes the code and models it names.

The measurement protocol (``docs/lab.md``): every result file records the commit, the command line,
n, seeds, tasks, lengths, library versions, threads, wall time and date of the run that made it, and
runs are *appended*, never replaced by a later, better one. A result file is
``{"format": "kvstate-results/1", "runs": [run, ...]}``; each run is ``{"provenance": {...}, ...}``
with the command's own result fields beside it.

Staleness is decided from content, not from dates: a run records a digest of every source file it
executed (``executed``: each kvstate module in ``sys.modules`` and each script under ``benchmarks/`` or
``scripts/``, the driver included, taken from what was imported rather than from a list kept by hand),
of the source the run names as its method's (``code``: the library axis and its lab slice; the seed
ledger's notion of "the same method", :mod:`kvstate.lab.ledger`) and of every model directory it read
(``models``: weights, configs, routers, codecs). The report recomputes them; a differing digest marks the
result ``stale``, names the changed files and the command that regenerates it. A file that predates
provenance (no ``format``) is read as one run without provenance, which is stale too.

What decides staleness is what the run executed, not what it names (issue 42): where a run recorded each
executed file's hash, a change to a file it never imported (a new method beside it in its axis) leaves it
current, and the named ``code`` digest — the seed ledger's identity of a method — is not consulted. Files that
only record, check or present a run (:data:`PRESENTATION`: this module, the ledger, the progress bar, the
report's page and plots) cannot change a measured value and are left out of the comparison, so bookkeeping
can change without marking every result stale.

A run appended to a result file under ``models/`` passes the seed ledger first (:func:`append_run`):
test seeds only, and a test seed already scored for a method only by that same, unchanged method.

Ignored: authenticity (a digest detects change, not tampering); a module imported after the run started is
hashed when the run finishes (an edit between its import and the end of the run goes unseen); source run
in another process (a subprocess's own imports).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from kvstate.io_safety import write_text_atomic
from kvstate.lab.results_file import FORMAT, REPO, SRC, read_runs

SCRIPT_DIRS = (REPO / "benchmarks", REPO / "scripts")  # driver scripts whose edits make a result stale
# executed files that record, check or present a run and never compute a measured value: their edits leave results
# current (each is tested not to be imported by a measurement for anything but recording and checking)
PRESENTATION = frozenset({"src/kvstate/lab/provenance.py", "src/kvstate/lab/ledger.py", "src/kvstate/lab/progress.py",
                          "src/kvstate/lab/results_file.py",
                          "src/kvstate/lab/report/html.py", "src/kvstate/lab/report/plots.py",
                          "src/kvstate/lab/report/docs.py"})
MODEL_JSON = {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json"}  # the JSON files that define a model (results and cards are not part of it)


def git_commit() -> str:
    """The commit of the source tree (``+ uncommitted changes`` when dirty), or ``unknown``."""
    try:
        head = subprocess.run(["git", "-C", str(SRC), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(SRC), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown (not a git checkout)"
    return f"{head} + uncommitted changes" if dirty else head


def environment() -> dict[str, Any]:
    """Machine threads and library versions (torch / transformers imported lazily)."""
    import numpy
    import torch
    import transformers

    return {
        "torch_threads": torch.get_num_threads(),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "unset"),
        "cpu_count": os.cpu_count() or 0,
        "machine": f"{platform.system()} {platform.machine()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "numpy": numpy.__version__,
    }


def _files(paths: Iterable[Path]) -> list[Path]:
    out: list[Path] = []
    for p in paths:
        if p.is_dir():
            out += sorted(q for q in p.rglob("*.py") if "__pycache__" not in q.parts)
        elif p.is_file():
            out.append(p)
    return out


def _digest(files: Sequence[Path], root: Path) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(f.relative_to(root).as_posix().encode() + b"\0")
        h.update(hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()[:16]


def code_digest(modules: Sequence[str]) -> str:
    """Digest of the source files under ``modules`` (paths relative to ``src/kvstate``, files or packages)."""
    return _digest(_files(SRC / m for m in modules), SRC)


def executed_files(script_dirs: Sequence[Path] | None = None) -> list[Path]:
    """Source files this process has executed: every kvstate module it imported and every script under
    ``script_dirs`` (default ``benchmarks/``, ``scripts/``) it imported or runs as ``__main__``."""
    roots = [SRC.resolve(), *(Path(d).resolve() for d in (SCRIPT_DIRS if script_dirs is None else script_dirs))]
    main = sys.modules.get("__main__")
    names = [getattr(m, "__file__", None) for m in list(sys.modules.values())]
    names += [getattr(main, "__file__", None), sys.argv[0] if sys.argv else None]
    found: set[Path] = set()
    for name in names:
        if not isinstance(name, str) or not name.endswith(".py"):
            continue
        p = Path(name).resolve()
        if p.is_file() and any(p.is_relative_to(r) for r in roots):
            found.add(p)
    return sorted(found)


def _file_hash(path: Path) -> str:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()[:12]
    except OSError:
        return "missing"


def _resolve_key(key: str) -> Path:
    return Path(key) if Path(key).is_absolute() else REPO / key


def executed_digest(files: dict[str, str]) -> str:
    """Digest of ``{file: content hash}`` (repository-relative names) for what a run executed."""
    h = hashlib.sha256()
    for key in sorted(files):
        h.update(f"{key}\0{files[key]}\0".encode())
    return h.hexdigest()[:16]


def model_digest(directory: str | Path) -> str:
    """Digest of what a model / router / codec directory holds that results depend on.

    Weights (``*.safetensors``) and configuration / tokenizer JSON; not the card, the checksum manifest,
    the training state, nor result files written into the directory.
    """
    d = Path(directory)
    if not d.is_dir():
        return "missing"
    files = sorted(p for p in d.iterdir() if p.is_file() and not p.name.startswith(".")
                   and (p.suffix == ".safetensors" or p.name in MODEL_JSON))
    return _digest(files, d)


def _repo_relative(p: str | Path) -> str:
    q = Path(p).resolve()
    try:
        return q.relative_to(REPO).as_posix()
    except ValueError:
        return str(p)


@dataclass
class Recorder:
    """Provenance of one run: create it before the work starts, call :meth:`finish` when it is done."""

    code: Sequence[str]  # source the results depend on (relative to src/kvstate), e.g. ("depth", "lab/depth")
    models: Sequence[str | Path] = ()  # model / router / codec directories the run read
    n: int | None = None  # items per cell
    seeds: Sequence[int] = ()
    tasks: Sequence[str] = ()
    lengths: Sequence[int] = ()
    command: str | None = None  # defaults to this process's command line
    settings: dict[str, Any] = field(default_factory=dict)  # anything else the run was configured with
    _t0: float = field(default_factory=time.perf_counter, repr=False)
    _started: str = field(default_factory=lambda: datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S"), repr=False)
    _digests: tuple[str, dict[str, str]] = field(init=False, repr=False)
    _executed: dict[Path, str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        # the code and models as the run starts: a file edited while it runs must not pass for what it ran
        self._digests = (code_digest(self.code), {_repo_relative(m): model_digest(m) for m in self.models})
        self._executed = {p: _file_hash(p) for p in executed_files()}

    def _executed_now(self) -> dict[str, Any]:
        # modules imported since the start (lazy imports) are hashed now; the rest as they were at the start
        files = {_repo_relative(p): self._executed.get(p) or _file_hash(p) for p in executed_files()}
        return {"digest": executed_digest(files), "files": files}

    def finish(self) -> dict[str, Any]:
        argv = [Path(sys.argv[0]).name, *sys.argv[1:]] if sys.argv and sys.argv[0] else []
        return {
            "commit": git_commit(),
            "command": self.command or shlex.join(argv),
            "date_utc": self._started,
            "wall_seconds": round(time.perf_counter() - self._t0, 1),
            "n": self.n,
            "seeds": list(self.seeds),
            "tasks": list(self.tasks),
            "lengths": list(self.lengths),
            "settings": self.settings,
            "code": {"modules": list(self.code), "digest": self._digests[0]},
            "executed": self._executed_now(),
            "models": dict(self._digests[1]),
            **environment(),
        }


def append_run(path: str | Path, run: dict[str, Any], provenance: dict[str, Any]) -> None:
    """Append ``run`` (with its ``provenance``) to the result file at ``path``, atomically; older runs kept.

    A file under ``models/`` takes the run only if the seed ledger does (:func:`kvstate.lab.ledger.record_run`:
    test seeds only, a used test seed only for the same unchanged method); the ledger entry is written first,
    so a run that reached a result file is always in the ledger.
    """
    from kvstate.lab.ledger import record_run

    p = Path(path)
    runs = read_runs(p) if p.is_file() else []
    record_run(p, provenance)
    runs = [*map(_finite, runs), _finite({"provenance": provenance, **run})]  # older files may hold NaN
    write_text_atomic(p, json.dumps({"format": FORMAT, "runs": runs}, indent=1, allow_nan=False) + "\n")


def _finite(value: Any) -> Any:
    """NaN / inf (a ratio with nothing measured, e.g. no baseline) become null: result files are strict JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


Status = Literal["current", "stale", "missing"]


@dataclass(frozen=True)
class Artifact:
    """The newest run of a committed result file, and whether it still describes the code and models."""

    path: str  # repository-relative path of the result file
    command: str  # the command that regenerates it
    status: Status
    reason: str  # why stale / missing ("" when current)
    run: dict[str, Any] | None  # the newest run (None when missing)
    runs: int  # runs kept in the file

    @property
    def provenance(self) -> dict[str, Any]:
        return dict((self.run or {}).get("provenance") or {})

    @property
    def commit(self) -> str | None:
        return self.provenance.get("commit")


def load_artifact(path: str | Path, command: str, *, select: Any = None) -> Artifact:
    """Read a committed result file and decide ``current`` / ``stale`` / ``missing``.

    ``command`` is what regenerates it (shown on stale / missing rows). ``select(run) -> bool`` picks the
    newest run that qualifies (default: the newest run).
    """
    p = Path(path)
    rel = _repo_relative(p)
    if not p.is_file():
        return Artifact(rel, command, "missing", "file not found", None, 0)
    runs = read_runs(p)
    chosen = [r for r in runs if select is None or select(r)]
    if not chosen:
        return Artifact(rel, command, "missing", "no run of the kind this row needs", None, len(runs))
    run = chosen[-1]
    prov = run.get("provenance")
    if not isinstance(prov, dict):
        return Artifact(rel, command, "stale", "no provenance recorded", run, len(runs))
    executed = prov.get("executed") or {}
    files = executed.get("files") if isinstance(executed, dict) else None
    if isinstance(files, dict):
        changed = [k for k, h in sorted(files.items()) if k not in PRESENTATION and _file_hash(_resolve_key(k)) != h]
        if changed:
            more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
            return Artifact(rel, command, "stale", f"{', '.join(changed[:3])}{more} changed since commit "
                            f"{prov.get('commit')}", run, len(runs))
    code = prov.get("code") or {}
    if not isinstance(files, dict) and code.get("digest") != code_digest(code.get("modules") or []):
        return Artifact(rel, command, "stale", f"source of {', '.join(code.get('modules') or [])} changed since "
                        f"commit {prov.get('commit')}", run, len(runs))
    for model, digest in (prov.get("models") or {}).items():
        path_m = Path(model) if Path(model).is_absolute() else REPO / model
        if model_digest(path_m) != digest:
            return Artifact(rel, command, "stale", f"{model} changed since the run", run, len(runs))
    return Artifact(rel, command, "current", "", run, len(runs))


__all__ = ["FORMAT", "PRESENTATION", "Artifact", "Recorder", "append_run", "code_digest", "environment", "executed_digest",
           "executed_files", "git_commit", "load_artifact", "model_digest", "read_runs"]
