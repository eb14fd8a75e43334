"""Stopping on request: the first SIGTERM/SIGINT lets the job finish its step, save and exit 0.

After that, a second SIGINT (Ctrl-C again) ends the process at once, but further SIGTERMs are ignored:
schedulers deliver SIGTERM more than once (SLURM's `--signal` reaches every process of the step, then
torchrun forwards its own), and the stop checkpoint must not die mid-write. torchrun still ends the
workers with SIGKILL once its shutdown timeout has passed.
"""

from __future__ import annotations

import signal


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
