"""Files written so that none is ever half-visible, and their fingerprints: the bottom floor that
checkpoints, data caches, regeneration parts and exports share.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


class SaveError(RuntimeError):
    """Writing a checkpoint or the run's records failed (disk full, permissions); every earlier checkpoint
    is untouched."""


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def describe_error(error: BaseException, with_type: bool = True) -> str:
    """One line for an exception: its type and the first line of its message (without the type: the first
    line alone, or the type's name when the message is empty)."""
    lines = str(error).strip().splitlines()
    first = lines[0] if lines else ""
    if not with_type:
        return first or type(error).__name__
    return f"{type(error).__name__}: {first}"


def atomic_write_text(path: Path, text: str) -> None:
    """Replace a small file so that it holds the old text or the new one, never a part (also after a power
    loss): written aside as .NAME-PID, fsynced, renamed, directory fsynced; the aside file is removed when
    any step fails (a full disk)."""
    tmp = path.with_name(f".{path.name}-{os.getpid()}")
    try:
        with tmp.open("w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def fingerprint_files(paths: list[Path]) -> str:
    """sha256 over the names and bytes of small identity files (config, tokenizer)."""
    h = hashlib.sha256()
    for p in sorted(paths):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]
