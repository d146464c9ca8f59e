"""Detecting corrupted files: a checksum manifest for model directories and a safetensors header check.

``kvstate train`` writes ``manifest.json`` into every model directory it saves: the SHA-256 and size of
each file it wrote (weights, config, tokenizer, training state). :func:`verify_manifest` recomputes them
and raises :class:`~kvstate.errors.IntegrityError` naming the file that changed; ``kvstate eval`` and the
report call it through :func:`kvstate.models.load_model`. Files added later (a model card) are not
covered. :func:`check_safetensors_header` is the cheap check for any ``.safetensors`` file: the 8-byte
header length, a JSON header, and tensor offsets that stay inside the file (a truncated copy fails it).
Ignored: authenticity (a checksum detects accidents, not tampering).
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Any

from kvstate.errors import IntegrityError
from kvstate.io_safety import write_text_atomic

MANIFEST = "manifest.json"
FORMAT = "kvstate-manifest/1"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_manifest(directory: str | Path) -> dict[str, Any]:
    """Record the SHA-256 and size of every regular file in ``directory`` (not recursing) in ``manifest.json``."""
    d = Path(directory)
    files = {p.name: {"sha256": _sha256(p), "bytes": p.stat().st_size}
             for p in sorted(d.iterdir()) if p.is_file() and p.name != MANIFEST and not p.name.startswith(".")}
    manifest = {"format": FORMAT, "files": files}
    write_text_atomic(d / MANIFEST, json.dumps(manifest, indent=1) + "\n")
    return manifest


def verify_manifest(directory: str | Path, *, required: bool = False) -> bool:
    """Check every file listed in ``directory/manifest.json``; True when verified, False when there is none.

    Raises :class:`IntegrityError` for a missing, resized or changed file, an unreadable manifest, or
    (with ``required``) no manifest at all.
    """
    d = Path(directory)
    path = d / MANIFEST
    if not path.is_file():
        if required:
            raise IntegrityError(f"{str(d)!r} has no {MANIFEST}; it was not written by kvstate train, or the "
                                 "manifest was removed — retrain, or call write_manifest() on a copy you trust")
        return False
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
        files = manifest["files"]
        if manifest.get("format") != FORMAT or not isinstance(files, dict):
            raise ValueError(f"format {manifest.get('format')!r}")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise IntegrityError(f"{str(path)!r} is not a kvstate manifest ({exc}); delete it or restore the "
                             "directory from its source") from None
    for name, want in files.items():
        p = d / name
        if not p.is_file():
            raise IntegrityError(f"{str(p)!r} is listed in {MANIFEST} but missing; restore it or retrain")
        if p.stat().st_size != want.get("bytes") or _sha256(p) != want.get("sha256"):
            raise IntegrityError(f"{str(p)!r} does not match its checksum in {MANIFEST} (changed or corrupted "
                                 "after kvstate train wrote it); restore it from its source or retrain")
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


def main() -> None:
    """``python -m kvstate.integrity DIR [...]``: write a manifest for directories you trust."""
    import sys

    for d in sys.argv[1:]:
        print(f"{d}: {len(write_manifest(d)['files'])} files")


if __name__ == "__main__":
    main()
