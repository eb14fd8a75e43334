"""How a rank ends when something fails: one line on stderr (and in torchrun's error file), the right exit
status, and in a split job an exit that does not hang on a receive or blame the wrong rank.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path

from dflash_ddp.parallel.run_lock import OutputDirLock


def lost_peer(error: RuntimeError) -> bool:
    """Whether a collective failed because another rank went away (gloo and NCCL word it differently).

    Matched on the message, not on the type: NCCL raises DistBackendError for its own bugs and out-of-memory
    too, and those must keep their traceback."""
    signs = (
        "Connection closed by peer",
        "Connection reset by peer",
        "Broken pipe",
        "remote process exited",
        "NCCL communicator was aborted",
    )
    return any(sign in str(error) for sign in signs)


# How long a rank that failed only because another rank did waits before exiting: longer than torchrun's
# 0.1 s monitor interval, so that torchrun records the first failure first and names it the root cause.
CONSEQUENCE_DELAY_S = 1.0


def fail(
    message: str, code: int, split: bool, consequence: bool = False, lock: OutputDirLock | None = None
) -> int:
    """Print this rank's one-line error and end the rank with `code`.

    In a split job the rank exits at once without tearing down the process group: the drafter's receiver
    thread may be blocked in a receive, and destroying the group under it aborts the process (SIGABRT,
    'terminate called without an active exception') after this message, and torchrun then blames another
    rank. A rank failing only as a `consequence` of another's failure first waits CONSEQUENCE_DELAY_S
    (torchrun's SIGTERM ends the wait at once). A background checkpoint write still in flight has been
    waited for by the loop's own cleanup before this point. The output directory's `lock` is released
    first: exiting skips `main`'s release, and a lock file still naming this job would make the next job
    report taking it over from one that ended without releasing it. The message also goes to torchrun's
    error file (write_error_file) unless this rank fails only as a consequence."""
    print(message, file=sys.stderr, flush=True)
    if not split:
        return code
    if not consequence:  # a consequence's file could make torchrun blame it instead of the rank that failed
        write_error_file(message)
    if lock:
        lock.release()
    if consequence:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
        time.sleep(CONSEQUENCE_DELAY_S)
    sys.stdout.flush()
    os._exit(code)


# How long a rank other than the first waits before printing its refusal to start. Under torchrun every rank
# usually reaches the same refusal (each parses the same flags and reads the same files); the first one
# exits at once and torchrun (0.1 s monitor interval) ends the others within this wait, so the line is
# printed once. A refusal that only this rank reaches (its GPU, its node's files) is still printed, later.
REFUSAL_ECHO_DELAY_S = 3.0


def write_error_file(message: str) -> bool:
    """Under torchrun, put `message` in this rank's error file, which torchrun shows as the "Root Cause"
    of its failure summary instead of "<N/A>"; False without torchrun."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")  # set by torchrun for each worker
    if not error_file:
        return False
    # the layout torchrun's ErrorHandler writes; its summary prints extraInfo.py_callstack
    info = {"py_callstack": message, "timestamp": str(int(time.time()))}
    with contextlib.suppress(OSError):
        Path(error_file).write_text(json.dumps({"message": {"message": message, "extraInfo": info}}))
    return True


def refuse(message: str, first: bool, split: bool, lock: OutputDirLock | None = None) -> int:
    """A refusal at start: `message` on stderr, exit status 2, printed once per job in a split job (see
    REFUSAL_ECHO_DELAY_S). Under torchrun the line also goes to this rank's error file, which torchrun shows
    as the "Root Cause" at the end of its failure summary (below its own traceback), and the rank exits at
    once (a normal interpreter exit takes seconds, in which the other ranks would print the line too),
    releasing the output directory's `lock` first as `fail` does."""
    if split and not first:
        time.sleep(REFUSAL_ECHO_DELAY_S)
    print(message, file=sys.stderr, flush=True)
    if split and write_error_file(message):
        if lock:
            lock.release()
        sys.stdout.flush()
        os._exit(2)
    return 2
