"""Detecting corrupted files: one checksum manifest for every directory kvstate saves, and a safetensors header check.

``manifest.json`` (format ``kvstate-manifest/2``) is the one schema of every directory kvstate writes:
``{"format", "kind", "files": {name: {"sha256", "bytes"}}, ...metadata}``. ``kind`` says what the
directory holds (``"model"``: ``kvstate train``'s weights, config, tokenizer and training state;
``"router"``: a SEKV router; ``"codec"``: an SCD codec) and the metadata fields are the saver's own (a
router's base-model fingerprint and config, a codec's fingerprints, ranks and geometry).
:func:`write_manifest` records the files; :func:`read_manifest` recomputes their checksums and returns
the manifest, raising :class:`~kvstate.errors.IntegrityError` naming the file that changed and the fix;
``kvstate eval`` and the report call :func:`verify_manifest` through :func:`kvstate.models.load_model`.
Files added later (a model card, evaluation results) are not covered. ``kvstate-manifest/1`` (a model
directory's checksums only) is still read, as kind ``"model"``. :func:`check_safetensors_header` is the
cheap check for any ``.safetensors`` file: the 8-byte header length, a JSON header, and tensor offsets
that stay inside the file (a truncated copy fails it). :func:`artifact_kind` tells what a directory
holds without verifying it (its manifest's kind, or the files a model / router / codec is made of) and
:func:`accepts_kind` turns that into the ``accept`` predicate of
:func:`kvstate.io_safety.check_output_dir`: a directory holding another kind is never written into;
:func:`is_trusted_file` says whether a file is one a manifest covers (never an output).
Ignored: authenticity (a checksum detects accidents, not tampering).
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from kvstate.errors import IntegrityError
from kvstate.io_safety import write_text_atomic

MANIFEST = "manifest.json"
FORMAT = "kvstate-manifest/2"
_FORMAT_1 = "kvstate-manifest/1"  # a model directory's checksums, no kind and no metadata
_RESERVED = ("format", "kind", "files")
RETRAIN = "restore it from its source or retrain"


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file's bytes, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_manifest(directory: str | Path, *, kind: str = "model", files: Iterable[str] | None = None,
                   meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """Record the SHA-256 and size of ``files`` in ``directory/manifest.json``, with ``kind`` and ``meta``.

    ``files``: names inside ``directory``; ``None`` means every regular, non-hidden file there (not
    recursing). ``meta``: JSON-serialisable fields stored at the top level next to them.
    """
    d = Path(directory)
    meta = meta or {}
    clash = sorted(set(meta) & set(_RESERVED))
    if clash:
        raise ValueError(f"write_manifest: meta keys {clash} are reserved for the manifest's own fields; rename them")
    names = sorted(files) if files is not None else [
        p.name for p in sorted(d.iterdir()) if p.is_file() and p.name != MANIFEST and not p.name.startswith(".")]
    listed = {n: {"sha256": sha256_file(d / n), "bytes": (d / n).stat().st_size} for n in names}
    manifest = {"format": FORMAT, "kind": kind, "files": listed, **meta}
    write_text_atomic(d / MANIFEST, json.dumps(manifest, indent=1, sort_keys=False) + "\n")
    return manifest


def refresh_manifest(directory: str | Path) -> dict[str, Any]:
    """Rewrite the checksums of the files ``directory``'s manifest lists (after the saver changed one of
    them), keeping its kind and metadata; the manifest is read without verifying the old checksums."""
    d = Path(directory)
    m = _parse(d / MANIFEST, RETRAIN)
    meta = {k: v for k, v in m.items() if k not in _RESERVED}
    return write_manifest(d, kind=m["kind"], files=list(m["files"]), meta=meta)


def _parse(path: Path, remedy: str) -> dict[str, Any]:
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(manifest, dict):
            raise TypeError("not a JSON object")
        fmt = manifest.get("format")
        if fmt == _FORMAT_1:
            manifest = {**manifest, "format": FORMAT, "kind": "model"}
        elif fmt != FORMAT:
            raise ValueError(f"format {fmt!r}, expected {FORMAT!r}")
        files = manifest["files"]
        if not isinstance(manifest.get("kind"), str) or not isinstance(files, dict) or not all(
                isinstance(v, dict) for v in files.values()):
            raise ValueError("kind / files of the wrong type")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise IntegrityError(f"{str(path)!r} is not a kvstate manifest ({exc}); {remedy}") from None
    return manifest


def read_manifest(directory: str | Path, *, kind: str | None = None, covers: Iterable[str] = (),
                  remedy: str = RETRAIN) -> dict[str, Any]:
    """The manifest of ``directory`` once every file it lists matches its checksum.

    Raises :class:`IntegrityError` naming the directory or file and ``remedy`` (the fix) for no manifest,
    an unreadable one, one of another ``kind``, one that does not list every name in ``covers``, or a
    missing, resized or changed file.
    """
    d = Path(directory)
    path = d / MANIFEST
    if not path.is_file():
        raise IntegrityError(f"{str(d)!r} has no {MANIFEST}; it was not written by kvstate, or the manifest was "
                             f"removed — {remedy}")
    manifest = _parse(path, remedy)
    if kind is not None and manifest["kind"] != kind:
        raise IntegrityError(f"{str(path)!r} describes a {manifest['kind']!r} directory, not a {kind!r} one; "
                             f"pass a {kind} directory")
    unlisted = sorted(set(covers) - set(manifest["files"]))
    if unlisted:
        raise IntegrityError(f"{str(path)!r} has no checksum for {', '.join(unlisted)}; {remedy}")
    for name, want in manifest["files"].items():
        p = d / name
        if not p.is_file():
            raise IntegrityError(f"{str(p)!r} is listed in {MANIFEST} but missing; {remedy}")
        if p.stat().st_size != want.get("bytes") or sha256_file(p) != want.get("sha256"):
            raise IntegrityError(f"{str(p)!r} does not match its checksum in {MANIFEST} (changed, truncated or "
                                 f"corrupted after kvstate wrote it); {remedy}")
    return manifest


def verify_manifest(directory: str | Path, *, required: bool = False) -> bool:
    """Check every file listed in ``directory/manifest.json``; True when verified, False when there is none.

    Raises :class:`IntegrityError` for a missing, resized or changed file, an unreadable manifest, or
    (with ``required``) no manifest at all.
    """
    d = Path(directory)
    if not (d / MANIFEST).is_file():
        if required:
            raise IntegrityError(f"{str(d)!r} has no {MANIFEST}; it was not written by kvstate train, or the "
                                 "manifest was removed — retrain, or call write_manifest() on a copy you trust")
        return False
    read_manifest(d, remedy="restore it from its source or retrain")
    return True


def check_safetensors_header(path: str | Path) -> int:
    """Number of tensors in a ``.safetensors`` file whose header is sound; :class:`IntegrityError` otherwise."""
    p = Path(path)
    size = p.stat().st_size
    where = f"{str(p)!r} ({size:,} bytes)"
    fix = "restore the file from its source or re-save the model"
    with p.open("rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise IntegrityError(f"{where} is too short to be safetensors; {fix}")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8:
            raise IntegrityError(f"{where} is truncated or not safetensors: header of {n:,} bytes; {fix}")
        try:
            header = json.loads(f.read(n))
        except (ValueError, UnicodeDecodeError):
            raise IntegrityError(f"{where} has a header that is not JSON; {fix}") from None
    if not isinstance(header, dict):
        raise IntegrityError(f"{where} has a header that is not a JSON object; {fix}")
    data = size - 8 - n
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    for name, info in tensors.items():
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and 0 <= offsets[0] <= offsets[1] <= data):
            raise IntegrityError(f"{where}: tensor {name!r} lies outside the file (truncated); {fix}")
    return len(tensors)


# the files that make a directory one kind of artifact when it has no (readable) manifest
KIND_FILES = {"model": ("config.json", "model.safetensors"), "router": ("router.safetensors",),
              "codec": ("codec.safetensors",)}


def artifact_kind(directory: str | Path) -> str | None:
    """What ``directory`` holds: its manifest's ``kind``, else ``"model"`` / ``"router"`` / ``"codec"`` when
    the files of one are there, else ``"other"`` for a non-empty directory and ``None`` for an empty or
    missing one. Reads no checksums (a cheap look before any work)."""
    d = Path(directory)
    if not d.is_dir() or not any(d.iterdir()):
        return None
    try:
        kind = json.loads((d / MANIFEST).read_text(encoding="utf-8")).get("kind")
        if isinstance(kind, str):
            return kind
    except (OSError, ValueError, AttributeError, UnicodeDecodeError):
        pass
    if (d / "model.safetensors.index.json").is_file():
        return "model"
    for kind, names in KIND_FILES.items():
        if all((d / n).is_file() for n in names):
            return kind
    return "other"


def accepts_kind(kind: str) -> Callable[[Path], bool]:
    """The ``accept`` predicate of :func:`kvstate.io_safety.check_output_dir` for an output of ``kind``: an
    empty directory or one holding that kind (a directory of any other kind is never written into)."""
    return lambda p: artifact_kind(p) in (None, kind)


def is_trusted_file(path: str | Path) -> bool:
    """True when ``path`` is listed in the manifest of its directory (a file no command may replace)."""
    p = Path(path)
    try:
        files = json.loads((p.parent / MANIFEST).read_text(encoding="utf-8")).get("files")
    except (OSError, ValueError, AttributeError, UnicodeDecodeError):
        return p.name == MANIFEST and p.is_file()
    return p.name == MANIFEST or (isinstance(files, dict) and p.name in files)


def main() -> None:
    """``python -m kvstate.integrity DIR [...]``: write a manifest for directories you trust."""
    import sys

    for d in sys.argv[1:]:
        print(f"{d}: {len(write_manifest(d)['files'])} files")


if __name__ == "__main__":
    main()
