"""Where checkpoints live and how they are named: step-NNNNNNNN directories, the files every save writes, and
the `latest` and `best` pointers, replaced atomically and never followed outside checkpoints/.
"""

from __future__ import annotations

import fcntl
import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from dflash_ddp.files import atomic_write_text, describe_error

MANIFEST = "manifest.json"


STEP_NAME = re.compile(r"step-\d{8}")


# Written by every save besides the rng-rank{i}.pt of each drafter rank.
REQUIRED_FILES = ("model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json", "config.json")


# Names a killed save can leave behind in checkpoints/ (removed once the job holds the output directory).
LEFTOVER_PREFIXES = (".tmp-", ".stale-", ".latest-", ".best-")


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def write_latest(root: Path, name: str) -> None:
    """Point checkpoints/latest at `name` atomically (after a power loss `latest` holds the old name or the
    new one, never nothing)."""
    atomic_write_text(root / "latest", name + "\n")


def read_latest(root: Path, report=print) -> Path | None:
    """The checkpoint `root/latest` names, or None (with a warning) unless it is a step-NNNNNNNN directory
    in `root` itself: `latest` is never followed elsewhere (`..`, an absolute path, an empty file)."""
    latest = root / "latest"
    if not latest.is_file():
        return None
    try:
        name = latest.read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        report(f"warning: ignoring {latest} ({describe_error(e)}); using the newest valid checkpoint")
        return None
    if not STEP_NAME.fullmatch(name) or not (root / name).is_dir():
        report(
            f"warning: ignoring {latest}: it names {name!r}, not a step-NNNNNNNN checkpoint in {root}; "
            "using the newest valid checkpoint"
        )
        return None
    return root / name


@contextmanager
def pointer_lock(root: Path) -> Iterator[None]:
    """An exclusive lock between rotation, which must not remove the checkpoint `best` names, and a writer of
    `best` (the watcher, another process), which must not name one rotation is removing: an flock on the
    checkpoints directory itself (no lock file to leave behind)."""
    fd = os.open(root, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing drops the flock


def read_best(root: Path) -> Path | None:
    """The checkpoint `root/best` names, or None (no file, unreadable, or not a step-NNNNNNNN directory in
    `root`: a best checkpoint moved aside by a resume from an earlier step)."""
    try:
        name = (root / "best").read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return root / name if STEP_NAME.fullmatch(name) and (root / name).is_dir() else None


def write_best(root: Path, name: str | None) -> bool:
    """Point checkpoints/best at `name` atomically (None removes it); False, and nothing changed, when that
    checkpoint no longer exists (rotation removed it first)."""
    with pointer_lock(root):
        if name is None:
            (root / "best").unlink(missing_ok=True)
            return True
        if not (root / name).is_dir():
            return False
        atomic_write_text(root / "best", name + "\n")
        return True


def step_dirs(root: Path) -> list[Path]:
    """The step-NNNNNNNN directories in a checkpoints folder, oldest first."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if STEP_NAME.fullmatch(p.name) and p.is_dir())


def resolve_checkpoint(path: Path) -> Path:
    """A checkpoint directory, or an output directory / its checkpoints/ folder (then `latest`, or the
    newest checkpoint when `latest` names nothing usable; the warning goes to stderr); the `latest` file
    itself stands for its folder."""
    if path.name == "latest" and path.is_file():
        path = path.parent
    for root in (path / "checkpoints", path):
        found = step_dirs(root)
        if (root / "latest").exists() or found:
            named = read_latest(root, report=lambda line: print(line, file=sys.stderr))
            return named or (found[-1] if found else path)
    return path
