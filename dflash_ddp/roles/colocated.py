"""One process (world size 1): the target runs here and feeds the drafter's loop directly."""

from __future__ import annotations

import time

from dflash_ddp.data.batch import padding_id
from dflash_ddp.parallel.channel import Message
from dflash_ddp.parallel.topology import DistributedContext
from dflash_ddp.roles.drafter import train_drafter
from dflash_ddp.setup.run import Run
from dflash_ddp.setup.target import build_extractor
from dflash_ddp.target_model.features import TargetFeatureExtractor


class LocalTarget:
    """The colocated `BatchSource`: the target runs in this process; its compute time is the 'wait'."""

    def __init__(self, extractor: TargetFeatureExtractor, run: Run):
        self.extractor, self.data = extractor, run.data
        self.pad_id = padding_id(run.setup.tokenizer)
        self.items = run.schedule.batches(run.first_batch, run.end_batch)
        self.wait_s = 0.0
        self.bytes_received = 0
        self.peak_buffered_bytes = 0  # nothing travels

    def get(self) -> Message:
        start = time.perf_counter()
        item = next(self.items)
        batch = self.data.batch(item.members, self.pad_id)
        device = self.extractor.device
        features, soft = self.extractor(batch.input_ids.to(device), batch.attention_mask.to(device))
        self.wait_s += time.perf_counter() - start
        return Message(g=item.g, epoch=item.epoch, batch=batch, features=features, soft=soft)

    def sender_stats(self, messages: list[Message]) -> dict[int, tuple[float, int, int]]:
        return {}  # nothing is sent in one process

    def stop_requested(self) -> str:
        return ""  # the only rank: a signal here is this process's own

    def drain(self) -> None:
        pass

    def release_targets(self) -> None:
        pass

    def close(self) -> None:
        pass


def run_colocated(ctx: DistributedContext, run: Run) -> bool:
    """One process: the target runs here and feeds the drafter's loop directly."""
    extractor = build_extractor(run.cfg, run.setup, ctx.device)
    return train_drafter(ctx, run, lambda trainer: LocalTarget(extractor, run))
