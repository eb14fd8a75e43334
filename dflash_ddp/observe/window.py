"""The drafter's logging window: what happened between two logged steps (tokens trained, time spent waiting
for batches and inside the step, bytes received, each target's send wait, queue depth and the most its
outstanding sends have held), as the record
metrics.jsonl gets.
"""

from __future__ import annotations

import time

import torch

from dflash_ddp.drafter.trainer import DrafterTrainer, StepResult
from dflash_ddp.parallel.machine import peak_resident_bytes


def peak_memory_bytes(device: torch.device) -> int:
    """This process's peak so far: allocated tensors on CUDA, resident memory on the CPU (to set against
    --plan's prediction)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return peak_resident_bytes()


class LoggingWindow:
    """What happened since the last logged step: tokens trained, time spent waiting for batches and inside
    trainer.step, bytes received, and each target's last send wait and queue depth."""

    def __init__(self, source, num_drafters: int, device: torch.device):
        self.source, self.num_drafters, self.device = source, num_drafters, device
        self.compute_s, self.senders = 0.0, {}
        self.restart()

    def restart(self) -> None:
        self.start, self.tokens = time.perf_counter(), 0.0
        self.wait_s, self.bytes, self.compute_at_start = (
            self.source.wait_s,
            self.source.bytes_received,
            self.compute_s,
        )

    def timed(self, step, micro_batches: list[tuple]) -> StepResult:
        """`step(micro_batches)` (the trainer's step), its time counted as compute."""
        start = time.perf_counter()
        result = step(micro_batches)
        self.compute_s += time.perf_counter() - start
        return result

    def metrics(self, trainer: DrafterTrainer, result: StepResult, epoch: int, tokens_seen: int) -> dict:
        """The logged record of this window (every drafter rank takes part in the sums)."""
        elapsed = time.perf_counter() - self.start
        waited, received = trainer.sum_over_drafters(
            torch.tensor([self.source.wait_s - self.wait_s, self.source.bytes_received - self.bytes])
        ).tolist()
        trainer.check_finite()
        metrics = result.metrics()
        metrics.update(
            epoch=epoch,
            tokens_seen=tokens_seen,
            tokens_per_s=self.tokens / elapsed,
            wait_fraction=waited / self.num_drafters / elapsed,
            hidden_state_bytes_per_s=received / elapsed,
            outside_compute_fraction=1.0 - (self.compute_s - self.compute_at_start) / elapsed,
            peak_memory_gib=peak_memory_bytes(self.device) / 2**30,
            target_send_wait_s={str(k): round(v[0], 3) for k, v in sorted(self.senders.items())},
            target_inflight={str(k): v[1] for k, v in sorted(self.senders.items())},
            # the most each target's outstanding sends have held: at most --max_inflight messages
            target_peak_send_mib={str(k): round(v[2] / 2**20, 3) for k, v in sorted(self.senders.items())},
            # and this drafter rank's messages received ahead of training: at most --max_inflight too
            drafter_peak_receive_mib=round(self.source.peak_buffered_bytes / 2**20, 3),
        )
        return metrics
