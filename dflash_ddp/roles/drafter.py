"""The drafter's loop, shared by the drafter ranks of a split job and the colocated process: take batches,
train, log, save. What differs between the two is the batch source's (roles/batch_source.py); what only the
drafter leader does (the display, metrics.jsonl, checkpoint writes) is `DrafterLeader`'s.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from dflash_ddp.checkpoint.trainer_state import restore_training, trainer_parts, trainer_state
from dflash_ddp.checkpoint.writer import CheckpointWriter, drafter_rng_states
from dflash_ddp.data.schedule import ScheduledBatch
from dflash_ddp.drafter.trainer import DrafterTrainer
from dflash_ddp.observe.progress import TrainingMonitor
from dflash_ddp.observe.window import LoggingWindow
from dflash_ddp.parallel.channel import ChannelError, ChannelReceiver, Message
from dflash_ddp.parallel.devices import compute_dtype
from dflash_ddp.parallel.signals import GracefulStop
from dflash_ddp.parallel.topology import DistributedContext, Topology, job_barrier
from dflash_ddp.roles.batch_source import BatchSource, ChannelSource
from dflash_ddp.setup.run import Run
from dflash_ddp.setup.trainer import build_trainer


def run_drafter(ctx: DistributedContext, run: Run) -> bool:
    """A drafter rank: receive the batches g = rank mod M from their target ranks and train on them.

    The channel opens only once the drafter is ready to train (built, restored, warmed up) and every rank
    has reached the same point, so that no send waits on set-up; it is torn down only after every END has
    been received."""
    topo = ctx.topology
    mine = [
        (g, topo.target_of(g))
        for g in range(run.first_batch, run.end_batch)
        if topo.drafter_of(g) == topo.rank
    ]

    def open_channel(trainer: DrafterTrainer) -> ChannelSource:
        trainer.warm_up()  # compiled and allocated before any target waits on this rank
        job_barrier("channel-open")
        receiver = ChannelReceiver(
            topo.rank,
            mine,
            topo.sender_ranks,
            ctx.device,
            compute_dtype(ctx.device),
            ctx.channel_device,
            max_buffered=run.cfg.max_inflight,
        )
        return ChannelSource(receiver, leader=topo.is_leader)

    stopped = train_drafter(ctx, run, open_channel)
    job_barrier("channel-closed")
    return stopped


def train_drafter(
    ctx: DistributedContext, run: Run, open_source: Callable[[DrafterTrainer], BatchSource]
) -> bool:
    """The drafter's loop: take A micro-batches, one optimizer step, log and save on the leader.

    `open_source(trainer)` gives the batches (the channel, or the target in this process) once the drafter
    is built and restored. On SIGTERM/SIGINT every drafter rank finishes the step it is in, the leader
    saves, the targets are told to stop and the channel is drained. Returns whether the run stopped early."""
    topo, cfg, schedule = ctx.topology, run.cfg, run.schedule
    group = ctx.drafter_group if topo.num_drafters > 1 else None
    trainer = build_trainer(cfg, run.setup, ctx.device, schedule.total_steps, group)
    index = topo.drafter_ranks.index(topo.rank)
    tokens_seen = restore_training(run.resume_from, trainer, index, run.start_step) if run.resume_from else 0
    source = open_source(trainer)
    leader = DrafterLeader(run, topo)
    window, stop, stopping = LoggingWindow(source, topo.num_drafters, ctx.device), GracefulStop(), False
    stop.install()
    expected = my_batches(run, topo)
    try:
        for step in range(run.start_step + 1, schedule.total_steps + 1):
            leader.check()  # a failed background save stops the run now, not at the next save
            messages = [
                check_batch(source.get(), next(expected), topo.rank)
                for _ in range(cfg.gradient_accumulation_steps)
            ]
            window.senders.update(source.sender_stats(messages))
            result = window.timed(trainer.step, [(m.batch, m.features, m.epoch, m.soft) for m in messages])
            # One all-reduce carries the step's tokens and whether any drafter rank was asked to stop,
            # so that every drafter rank stops after the same step.
            requested_by = stop.signal_name or source.stop_requested()
            step_tokens, stop_votes = trainer.sum_over_drafters(
                torch.tensor([float(sum(m.batch.num_tokens for m in messages)), float(bool(requested_by))])
            ).tolist()
            stopping, tokens_seen = stop_votes > 0, tokens_seen + int(step_tokens)
            window.tokens += step_tokens
            if step % cfg.logging_steps == 0 or step == schedule.total_steps:
                leader.log(window.metrics(trainer, result, messages[-1].epoch, tokens_seen))
                window.restart()
            if step % cfg.save_steps == 0 or step == schedule.total_steps or stopping:
                cursor = data_cursor(run, step, messages[-1].epoch, tokens_seen)
                leader.save(trainer, cursor, drafter_rng_states(group))  # every drafter rank gathers RNG
            if stopping:
                leader.print(
                    f"stop requested ({requested_by or 'on another drafter rank'}): stopped after step {step}"
                )
                break
        if stopping:
            end_early(source, group)
        source.close()
        leader.finish()
    finally:
        leader.close()
    return stopping


def end_early(source: BatchSource, group) -> None:
    """After a stop: every drafter rank drops incoming batches before any target is let go."""
    source.drain()
    if group is not None:
        dist.barrier(group=group)
    source.release_targets()


class DrafterLeader:
    """What the drafter leader alone does: the progress display and metrics.jsonl (TrainingMonitor) and the
    checkpoint writes (CheckpointWriter). On the other drafter ranks every method does nothing but the
    finite-loss check a save needs, which all ranks take part in."""

    def __init__(self, run: Run, topo: Topology):
        self.run, self.topo = run, topo
        self.monitor = self.writer = None
        if topo.is_leader:
            out, protect = Path(run.cfg.output_dir), {run.resume_from.name} if run.resume_from else set()
            self.monitor = TrainingMonitor(out, run.schedule.total_steps, run.start_step, run.trackers)
            self.writer = CheckpointWriter(out, run.cfg.save_total_limit, protect, self.monitor.print)

    def check(self) -> None:
        """Raise now if a background save failed."""
        if self.writer:
            self.writer.check()

    def log(self, metrics: dict) -> None:
        if self.monitor:
            self.monitor.log(metrics)

    def print(self, message: str) -> None:
        if self.monitor:
            self.monitor.print(message)

    def save(self, trainer: DrafterTrainer, cursor: dict, rng_states: dict) -> None:
        """Check the loss was finite since the start (never a checkpoint of weights a non-finite step
        touched), then save a checkpoint of the trainer at `cursor` in the background."""
        trainer.check_finite()
        if self.writer:
            state = trainer_state(self.run.identity, self.topo, cursor, self.run.schedule.total_steps)
            parts, config = trainer_parts(trainer), trainer.drafter.config
            self.writer.save(cursor["global_step"], parts, config, state, rng_states)

    def finish(self) -> None:
        """The last checkpoint is on disk before the job reports success."""
        if self.writer:
            self.writer.wait()
            self.monitor.print(f"checkpoint saves paused training for {self.writer.stall_s:.2f} s in total")

    def close(self) -> None:
        if self.writer:
            self.writer.wait(raise_error=False)
        if self.monitor:
            self.monitor.close()


def my_batches(run: Run, topo: Topology) -> Iterator[ScheduledBatch]:
    """The scheduled batches this drafter rank trains on, in order."""
    return (
        item
        for item in run.schedule.batches(run.first_batch, run.end_batch)
        if topo.drafter_of(item.g) == topo.rank
    )


def data_cursor(run: Run, step: int, epoch: int, tokens_seen: int) -> dict:
    """Where the data stands after optimizer step `step`: what a resume continues from."""
    consumed = run.first_batch + (step - run.start_step) * run.schedule.batches_per_step
    return {"global_step": step, "epoch": epoch, "batches_consumed": consumed, "tokens_seen": tokens_seen}


def check_batch(message: Message, item: ScheduledBatch, rank: int) -> Message:
    """Lockstep safety: the batch that arrived must be the one this rank's schedule says comes next."""
    if message.g != item.g or message.batch.sample_ids.tolist() != item.members:
        raise ChannelError(
            f"drafter rank {rank}: expected global batch {item.g} with samples {item.members[:8]}..., got batch "
            f"{message.g} with samples {message.batch.sample_ids.tolist()[:8]}... from rank {message.source}: "
            "the ranks disagree about the data (different --data files or settings per rank?)"
        )
    return message
