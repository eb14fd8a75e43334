"""Where the drafter's batches come from: one interface for the hidden-state channel (a split job) and the
target in this process (colocated, roles/colocated.py), so that the drafter's loop reads the same either way.
"""

from __future__ import annotations

from typing import Protocol

from dflash_ddp.parallel.channel import ChannelReceiver, Message
from dflash_ddp.parallel.signals import StopFlag


class BatchSource(Protocol):
    """The batches of one drafter rank, in its schedule's order, and what the job's stop needs of them."""

    wait_s: float  # seconds the drafter has waited for batches so far
    bytes_received: int  # hidden-state bytes received so far
    peak_buffered_bytes: int  # the most bytes of messages received ahead of training (0 in one process)

    def get(self) -> Message:
        """The next scheduled batch."""

    def sender_stats(self, messages: list[Message]) -> dict[int, tuple[float, int, int]]:
        """{target rank: (its cumulative send wait, its queue depth, the most bytes its outstanding sends
        have held)} as the messages carry them; {} when nothing was sent."""

    def stop_requested(self) -> str:
        """Who asked the job to stop from another rank ("" for none)."""

    def drain(self) -> None:
        """Stop early: drop whatever still arrives."""

    def release_targets(self) -> None:
        """After a stop (and its save): let the target ranks end."""

    def close(self) -> None:
        """Wait for the stream's clean end."""


class ChannelSource:
    """A split job's drafter rank: batches from the channel. The drafter leader also hears the stop requests
    target ranks post, and, once it has saved, raises the stop every target polls."""

    def __init__(self, receiver: ChannelReceiver, leader: bool):
        self.receiver = receiver
        self.flag = StopFlag() if leader else None

    @property
    def wait_s(self) -> float:
        return self.receiver.wait_s

    @property
    def bytes_received(self) -> int:
        return self.receiver.bytes_received

    @property
    def peak_buffered_bytes(self) -> int:
        return self.receiver.peak_bytes

    def get(self) -> Message:
        return self.receiver.get()

    def sender_stats(self, messages: list[Message]) -> dict[int, tuple[float, int, int]]:
        return {m.source: (m.sender_wait_s, m.sender_inflight, m.sender_peak_bytes) for m in messages}

    def stop_requested(self) -> str:
        return self.flag.requested() if self.flag else ""

    def drain(self) -> None:
        self.receiver.drain()

    def release_targets(self) -> None:
        if self.flag:
            self.flag.set()

    def close(self) -> None:
        self.receiver.close()
