"""One job per output directory: the drafter leader holds an exclusive lock on it for the whole job.

The lock is a `flock` on OUTPUT_DIR/.dflash_ddp.lock (NFS clients map it to a POSIX lock, which the
server arbitrates between nodes). The kernel releases it when the holder dies, however it dies, so a
lock is never stale: its file only still names the dead holder, which the next job reports and takes
over. The file names the holder (host, pid, start time) so that a refused job can say who has it. The leader
takes it first thing, before the target loads and the data is tokenized, so a second job is refused in
seconds; a job refused at start removes the directory it created for the lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from pathlib import Path

LOCK_FILE = ".dflash_ddp.lock"
LOCK_ATTEMPTS = 10  # a lock file removed under a starting job is taken anew this many times at most


class OutputDirLock:
    """An exclusive lock on an output directory, held until `release()` or the end of the process."""

    def __init__(self, output_dir: str | Path):
        self.path = Path(output_dir) / LOCK_FILE
        self._file = None
        self._made_dir = False  # whether this job created the directory (see `release`)

    def acquire(self) -> list[str]:
        """Take the lock or raise ValueError naming its holder. Returns lines to print."""
        for _ in range(LOCK_ATTEMPTS):
            self._made_dir = not self.path.parent.exists()
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                if (
                    self.path.is_symlink()
                ):  # a link planted as the lock file: this job would truncate its target
                    raise OSError(f"{self.path} is a symbolic link; remove it")
                f = self.path.open("a+")
            except FileNotFoundError:  # a job refused at start removed the directory it made meanwhile
                continue
            except OSError as e:
                raise ValueError(
                    f"--output_dir {self.path.parent}: cannot create it or its lock file ({e})"
                ) from None
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _describe(_read(f))
                f.close()
                raise ValueError(
                    f"--output_dir {self.path.parent} is in use by another job ({holder}): wait for it to end, "
                    "stop it, or pass another --output_dir"
                ) from None
            except OSError as e:  # ENOSYS, ENOLCK: Lustre mounted without flock, some NFS setups
                f.close()
                raise ValueError(
                    f"--output_dir {self.path.parent}: its filesystem does not lock files ({e}), which keeps a "
                    "second job from writing into a running job's directory; pass a directory on one that "
                    "does (a local disk; Lustre mounted with -o flock)"
                ) from None
            if _is_file_at(f, self.path):
                break
            f.close()  # a job refused at start removed the file it held after this one opened it: take anew
        else:
            raise ValueError(
                f"--output_dir {self.path.parent}: its lock file kept changing under this job ({LOCK_ATTEMPTS} "
                "tries: other jobs starting on it?); pass another --output_dir or start one job at a time"
            )
        previous = _read(f)
        f.seek(0)
        f.truncate()
        me = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        }
        f.write(json.dumps(me) + "\n")
        f.flush()
        os.fsync(f.fileno())
        self._file = f
        if previous:
            return [
                f"took over the lock of {self.path.parent} from a job that ended without releasing it ({_describe(previous)})"
            ]
        return []

    def release(self) -> None:
        """Clear the holder's name and unlock (a crash skips this; the kernel unlocks anyway). A directory
        this job created and left holding nothing but the lock (a job refused at start) is removed, still
        locked, so that a bad flag leaves nothing behind."""
        if self._file is None:
            return
        with contextlib.suppress(OSError):
            if self._made_dir and [p.name for p in self.path.parent.iterdir()] == [LOCK_FILE]:
                self.path.unlink()
                self.path.parent.rmdir()
            else:
                self._file.seek(0)
                self._file.truncate()
        self._file.close()  # closing the last descriptor releases the flock
        self._file = None


def _is_file_at(f, path: Path) -> bool:
    """Whether the open file `f` is the one at `path` (not one removed from there since it was opened)."""
    try:
        now = path.stat()
    except FileNotFoundError:
        return False
    opened = os.fstat(f.fileno())
    return (opened.st_dev, opened.st_ino) == (now.st_dev, now.st_ino)


def _read(f) -> dict:
    f.seek(0)
    try:
        data = json.loads(f.read() or "{}")
    except ValueError:
        return {"unreadable": True}
    return data if isinstance(data, dict) else {"unreadable": True}


def _describe(holder: dict) -> str:
    if not holder or "unreadable" in holder:
        return "holder unknown"
    return f"host {holder.get('host')}, pid {holder.get('pid')}, started {holder.get('started')}"
