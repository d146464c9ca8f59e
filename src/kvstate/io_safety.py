"""Nothing lost on disk: outputs are checked before work starts, built aside and moved into place whole.

The write-to-a-temporary-sibling-then-rename technique (a ``rename`` within one filesystem is atomic on
POSIX): a file or a whole output directory is written next to its destination under a hidden name and
renamed over it only once complete, so an interrupted or failed run leaves the previous output
untouched and whole. An output directory that already holds something is refused unless the caller
passes ``overwrite``, and one holding something of another kind than the output (a caller's ``accept``
predicate: a report, a router, a codec) is never written into; an output that cannot be written (a
path under a read-only or pseudo filesystem, an existing file where a directory is wanted) is found by
:func:`check_output_dir` before any work.
Written files get the permissions of an ordinary ``open`` (``0666 & ~umask``, normally 0644), not
``mkstemp``'s 0600. Ignored: concurrent writers to the same destination (the last one wins), and the
short moment of a directory replacement in which the old directory is renamed aside and the new one
not yet in place.
:func:`check_not_input` refuses an output that is one of the command's inputs, lies inside one, or would
replace a directory holding one.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from kvstate.errors import InputFileError, OutputError


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def normal_permissions(path: Path) -> None:
    """Files ``0666 & ~umask`` and directories ``0777 & ~umask`` under ``path`` (mkstemp/mkdtemp make 0600/0700)."""
    mask = _umask()
    paths = [path] + (list(path.rglob("*")) if path.is_dir() else [])
    for p in paths:
        if not p.is_symlink():
            p.chmod((0o777 if p.is_dir() else 0o666) & ~mask)


def _nearest_existing(path: Path) -> Path:
    p = path.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def check_output_dir(path: str | Path, *, overwrite: bool = False, option: str = "--out",
                     accept: Callable[[Path], bool] | None = None, kind: str = "") -> Path:
    """Raise :class:`OutputError` unless ``path`` can receive a new output directory; changes nothing on disk.

    Refused: an existing file; a non-empty directory unless ``overwrite``; with ``accept`` (a predicate
    saying whether a directory holds output of the kind being written, described by ``kind``, e.g.
    ``"a kvstate report"``), a non-empty directory it rejects, even with ``overwrite``: a directory that
    holds something of another kind is never written into; a location where no directory can be created
    (probed by creating and removing a temporary directory in the nearest existing parent).
    """
    p = Path(path)
    here = Path.cwd().resolve()
    if p.resolve() == here or p.resolve() in here.parents:  # replacing it would delete the working directory
        raise OutputError(f"{option} {str(p)!r} is the working directory or one above it; pass a new subdirectory")
    if p.exists() and not p.is_dir():
        raise OutputError(f"{option} {str(p)!r} is an existing file, not a directory; pass a directory path")
    if p.is_dir() and any(p.iterdir()):
        names = sorted(c.name for c in p.iterdir())
        held = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
        if accept is not None and not accept(p):
            raise OutputError(f"{option} {str(p)!r} exists and is not {kind or 'output of this kind'}: it holds "
                              f"{held}; choose a new or empty directory, or remove it yourself")
        if not overwrite:
            raise OutputError(f"{option} {str(p)!r} already holds output ({held}); pass --overwrite to replace it "
                              "whole, or choose a new directory")
    base = _nearest_existing(p.parent)
    if not base.is_dir():
        raise OutputError(f"{option} {str(p)!r}: {str(base)!r} is a file, so no directory can be made under it; "
                          "pass a path under a directory")
    try:
        os.rmdir(tempfile.mkdtemp(dir=base, prefix=".kvstate-probe-"))
    except OSError as exc:
        raise OutputError(f"{option} {str(p)!r} cannot be written ({exc.strerror or exc} in {str(base)!r}); "
                          "pass a writable location") from None
    return p


def check_not_input(out: str | Path, inputs: dict[str, str | Path | None], option: str = "--out") -> Path:
    """Raise :class:`OutputError` when ``out`` is an input (``{"--model": path, ...}``), lies inside one, or
    holds one (replacing ``out`` would delete it); changes nothing on disk."""
    o = Path(out).resolve()
    for name, value in inputs.items():
        if value is None:
            continue
        i = Path(value).resolve()
        if o == i:
            where = "is"
        elif i in o.parents:
            where = "lies inside"
        elif o in i.parents:
            where = "holds"
        else:
            continue
        raise OutputError(f"{option} {str(out)!r} {where} the input {name} {str(value)!r}; an output never replaces "
                          f"or writes into an input — pass a new {option} path")
    return Path(out)


def replace_dir(built: Path, dest: Path) -> None:
    """Move the complete directory ``built`` to ``dest``, replacing any directory there; both on one filesystem."""
    normal_permissions(built)
    if not dest.exists():
        os.replace(built, dest)
        return
    old = dest.parent / f".{dest.name}.old-{uuid.uuid4().hex[:8]}"
    os.replace(dest, old)
    try:
        os.replace(built, dest)
    except BaseException:
        os.replace(old, dest)  # put the previous output back whole
        raise
    shutil.rmtree(old, ignore_errors=True)


@contextmanager
def staged_dir(dest: str | Path, *, keep: bool = False) -> Iterator[Path]:
    """A temporary sibling of ``dest`` to write into; on success it replaces ``dest`` whole, on error it is removed.

    With ``keep`` the sibling starts as a copy of what ``dest`` holds, so files the caller does not
    rewrite (results written next to a saved artifact) survive the replacement.
    """
    d = Path(dest)
    d.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=d.parent, prefix=f".{d.name}.tmp-"))
    try:
        if keep and d.is_dir():
            shutil.copytree(d, tmp, symlinks=True, dirs_exist_ok=True)
        yield tmp
        replace_dir(tmp, d)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    """Write ``data`` to a temporary sibling of ``path`` and rename it over ``path`` (normal permissions).

    Missing parent directories are created.
    """
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text_atomic(path: str | Path, text: str) -> None:
    """:func:`write_bytes_atomic` of ``text`` encoded as UTF-8."""
    write_bytes_atomic(path, text.encode("utf-8"))


def read_text_input(path: str | Path, option: str) -> str:
    """The UTF-8 text of an input file, or :class:`InputFileError` naming ``option``, the path and the fix."""
    p = Path(path)
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise InputFileError(f"{option} {str(p)!r} is not UTF-8 text (byte {exc.start}: {exc.reason}); "
                             "pass a UTF-8 file") from None
    except OSError as exc:
        raise InputFileError(f"{option} {str(p)!r} cannot be read ({exc.strerror or exc}); pass a readable file") from None


def check_output_file(path: str | Path, option: str) -> Path:
    """Raise :class:`OutputError` unless a file can be written at ``path`` (its directory exists and is writable)."""
    p = Path(path)
    if p.is_dir():
        raise OutputError(f"{option} {str(p)!r} is a directory; pass a file path")
    if not p.parent.is_dir():
        raise OutputError(f"{option} {str(p)!r}: directory {str(p.parent)!r} does not exist; create it first")
    try:
        fd, probe = tempfile.mkstemp(dir=p.parent, prefix=".kvstate-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise OutputError(f"{option} {str(p)!r} cannot be written ({exc.strerror or exc}); pass a writable path") from None
    return p
