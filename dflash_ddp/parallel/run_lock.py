"""One job per output directory: the drafter leader holds an exclusive lock on it for the whole job.

The lock is a `flock` on OUTPUT_DIR/.dflash_ddp.lock (NFS clients map it to a POSIX lock, which the
server arbitrates between nodes). The kernel releases it when the holder dies, however it dies, so a
lock is never stale: its file only still names the dead holder, which the next job reports and takes
over. The file names the holder (host, pid, start time) so that a refused job can say who has it.
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


class OutputDirLock:
    """An exclusive lock on an output directory, held until `release()` or the end of the process."""

    def __init__(self, output_dir: str | Path):
        self.path = Path(output_dir) / LOCK_FILE
        self._file = None

    def acquire(self) -> list[str]:
        """Take the lock or raise ValueError naming its holder. Returns lines to print."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            f = self.path.open("a+")
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
        """Clear the holder's name and unlock (a crash skips this; the kernel unlocks anyway)."""
        if self._file is None:
            return
        with contextlib.suppress(OSError):
            self._file.seek(0)
            self._file.truncate()
        self._file.close()  # closing the last descriptor releases the flock
        self._file = None


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
