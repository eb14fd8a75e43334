"""Where a drafter step's time goes: seconds per part (blocks, forward, loss, backward, optimizer), summed
until read. Off unless asked for (the step-cost benchmark turns it on): on a GPU, timing a part means waiting
for the device at both of its ends, which a training run must not do every step."""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict

import torch


class StepTimer:
    """Accumulates wall seconds per named part; `enabled=False` makes `part` a no-op."""

    def __init__(self, device: torch.device | None = None, enabled: bool = True):
        self.enabled = enabled
        self.cuda = device is not None and device.type == "cuda"
        self.seconds: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def part(self, name: str):
        """Time the enclosed code as (a piece of) `name`."""
        if not self.enabled:
            yield
            return
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.seconds[name] += time.perf_counter() - start

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def take(self) -> dict[str, float]:
        """The seconds per part since the last take, and start again from zero."""
        seconds, self.seconds = dict(self.seconds), defaultdict(float)
        return seconds
