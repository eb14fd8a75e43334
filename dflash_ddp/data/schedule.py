"""The job's sequence of global batches: g = 0, 1, 2, ... across epochs, the same on every rank.

Batch g's content depends only on (seed, epoch, data, batching settings) - never on the number of
ranks - so any split of the job into target and drafter ranks trains on the same batches in the same
optimizer steps.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

WINDOW_BATCHES = 1024  # length-sorting window, in batches of longest samples


LENGTH_JITTER = 0.05  # sort keys are lengths times 1..1.05: ~2% padding buys new batch neighbours each epoch


def epoch_batches(lengths: list[int], tokens_per_batch: int, seed: int, epoch: int) -> list[list[int]]:
    """The global batches of one epoch, as lists of sample indices.

    A seeded permutation, cut into windows; each window sorted by length (randomly jittered by up to 5%,
    so that samples of similar length meet different neighbours every epoch even when the whole data set
    is one window) and packed greedily under the padded-token budget B * max_len <= tokens_per_batch;
    then a seeded shuffle of all batches. Every sample appears once per epoch.
    """
    rng = random.Random(f"dflash-batches:{seed}:{epoch}")
    order = list(range(len(lengths)))
    rng.shuffle(order)
    window = WINDOW_BATCHES * max(1, tokens_per_batch // max(1, max(lengths)))
    batches = []
    for start in range(0, len(order), window):
        keys = {i: lengths[i] * (1 + LENGTH_JITTER * rng.random()) for i in order[start : start + window]}
        current, longest = [], 0
        for i in sorted(keys, key=lambda i: (keys[i], i)):
            longest_if_added = max(longest, lengths[i])
            if current and longest_if_added * (len(current) + 1) > tokens_per_batch:
                batches.append(current)
                current, longest_if_added = [], lengths[i]
            current.append(i)
            longest = longest_if_added
        if current:
            batches.append(current)
    rng.shuffle(batches)
    return batches


@dataclass(frozen=True)
class ScheduledBatch:
    """Global batch g: its epoch, its place in the epoch and the sample indices it holds."""

    g: int  # global batch index
    epoch: int
    index: int  # position within its epoch
    members: list[int]  # sample indices


class BatchSchedule:
    """Global batches for `total_steps` optimizer steps of `batches_per_step` batches each."""

    def __init__(
        self, lengths: list[int], tokens_per_batch: int, seed: int, batches_per_step: int, total_steps: int
    ):
        self.lengths = lengths
        self.tokens_per_batch = tokens_per_batch
        self.seed = seed
        self.batches_per_step = batches_per_step
        self.total_steps = total_steps
        per_epoch = len(self.epoch(0))
        if per_epoch < batches_per_step:
            raise ValueError(
                f"an epoch has only {per_epoch} batches but one optimizer step takes {batches_per_step} "
                "(drafter ranks x gradient accumulation): lower --tokens_per_batch, --drafter_ranks or "
                "--gradient_accumulation_steps"
            )

    @classmethod
    def for_epochs(cls, lengths, tokens_per_batch, seed, batches_per_step, num_epochs) -> BatchSchedule:
        """Enough whole optimizer steps to cover `num_epochs` epochs (a partial last step is dropped)."""
        total = sum(len(epoch_batches(lengths, tokens_per_batch, seed, e)) for e in range(num_epochs))
        return cls(lengths, tokens_per_batch, seed, batches_per_step, max(1, total // batches_per_step))

    @property
    def total_batches(self) -> int:
        """Global batches in the whole run."""
        return self.total_steps * self.batches_per_step

    def epoch(self, epoch: int) -> list[list[int]]:
        """The batches of one epoch (computed, not stored)."""
        return epoch_batches(self.lengths, self.tokens_per_batch, self.seed, epoch)

    def batches(self, start: int, stop: int) -> Iterator[ScheduledBatch]:
        """Global batches start..stop-1 (across epochs as needed), computing only the epochs they touch."""
        g, epoch = 0, 0
        while g < stop:
            members_of_epoch = self.epoch(epoch)
            if g + len(members_of_epoch) <= start:  # an epoch entirely before the start: skip it whole
                g += len(members_of_epoch)
                epoch += 1
                continue
            for index, members in enumerate(members_of_epoch):
                if start <= g < stop:
                    yield ScheduledBatch(g, epoch, index, members)
                g += 1
            epoch += 1

    def __iter__(self) -> Iterator[ScheduledBatch]:
        return self.batches(0, self.total_batches)
