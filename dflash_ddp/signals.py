"""Stopping on request: the first SIGTERM/SIGINT lets the job finish its step, save and exit 0; a second
one takes the default action (the process ends at once)."""

from __future__ import annotations

import signal


class GracefulStop:
    """Records a stop request; installed once per process, in the main thread."""

    def __init__(self):
        self.requested = False
        self.signal_name = ""

    def install(self) -> GracefulStop:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, _frame) -> None:
        self.requested = True
        self.signal_name = signal.Signals(signum).name
        for sig in (signal.SIGTERM, signal.SIGINT):  # a second signal is not caught: it ends the process
            signal.signal(sig, signal.SIG_DFL)
