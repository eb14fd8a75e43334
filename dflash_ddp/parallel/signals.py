"""Stopping on request: the first SIGTERM/SIGINT lets the job finish its step, save and exit 0; a rank that
gets the signal tells the others through the job's store (`StopFlag`).

After that, a second SIGINT (Ctrl-C again) ends the process at once, but further SIGTERMs are ignored:
schedulers deliver SIGTERM more than once (SLURM's `--signal` reaches every process of the step, then
torchrun forwards its own), and the stop checkpoint must not die mid-write. torchrun still ends the
workers with SIGKILL once its shutdown timeout has passed.
"""

from __future__ import annotations

import signal

from dflash_ddp.parallel.topology import job_store


class GracefulStop:
    """Records a stop request; installed once per process, in the main thread."""

    def __init__(self):
        self.requested = False
        self.signal_name = ""

    def install(self) -> GracefulStop:
        """Catch SIGTERM and SIGINT from now on."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, _frame) -> None:
        self.requested = True
        self.signal_name = signal.Signals(signum).name
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


class StopFlag:
    """Stopping early, through the job's key-value store (a polled irecv is not an option: gloo never marks
    it completed without wait()). Any rank that receives a signal posts a request, naming itself; the
    drafter leader reads requests at each step boundary, saves, and then sets the stop that every target
    polls between batches."""

    KEY = "dflash_ddp/stop"
    REQUEST_KEY = "dflash_ddp/stop_request"

    def __init__(self):
        self.store = job_store()

    def set(self) -> None:
        self.store.set(self.KEY, "1")

    def is_set(self) -> bool:
        return self.store.check([self.KEY])

    def request(self, who: str) -> None:
        """Ask the leader to stop the job (`who`: e.g. "SIGTERM on rank 1")."""
        self.store.set(self.REQUEST_KEY, who)

    def requested(self) -> str:
        """Who asked the job to stop, or "" (one store round trip; the leader asks once per step)."""
        return self.store.get(self.REQUEST_KEY).decode() if self.store.check([self.REQUEST_KEY]) else ""


def _interrupt(signum, _frame) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def interrupt_on_sigterm(on: bool) -> None:
    """SIGTERM raises KeyboardInterrupt("SIGTERM") (`on`), or ends the process as by default: for a start-up
    whose leader must release what it holds when torchrun ends the job."""
    signal.signal(signal.SIGTERM, _interrupt if on else signal.SIG_DFL)


def interrupt_on_stop() -> None:
    """From now on SIGINT and SIGTERM interrupt at once (KeyboardInterrupt): for the work after training (the
    final evaluation), which has no step to finish and nothing to save."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _interrupt)
