"""The drafter's loop, shared by the drafter ranks of a split job and the colocated process: receive batches,
train, log, save; building and restoring the trainer before the first step.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist

from dflash_ddp.checkpoint.reader import read_tensor_file
from dflash_ddp.checkpoint.resume import (
    RestoreError,
    load_trainer_state,
    load_weights,
    restore_rng,
)
from dflash_ddp.checkpoint.writer import CheckpointWriter, drafter_rng_states
from dflash_ddp.config import TrainConfig
from dflash_ddp.data.schedule import ScheduledBatch
from dflash_ddp.drafter.config import resolve_attention
from dflash_ddp.drafter.trainer import DrafterTrainer, OptimizerSettings, StepSettings, build_drafter
from dflash_ddp.drafter.weighting import LossSettings
from dflash_ddp.files import describe_error
from dflash_ddp.observe.progress import TrainingMonitor
from dflash_ddp.parallel.channel import ChannelError, ChannelReceiver, Message
from dflash_ddp.parallel.machine import peak_resident_bytes
from dflash_ddp.parallel.signals import GracefulStop, StopFlag
from dflash_ddp.parallel.topology import DistributedContext, Topology, compute_dtype, job_barrier
from dflash_ddp.setup.run import Run, RunSetup
from dflash_ddp.target_model.head import SharedTargetHead


def peak_memory_bytes(device: torch.device) -> int:
    """This process's peak so far: allocated tensors on CUDA, resident memory on the CPU (to set against
    --plan's prediction)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return peak_resident_bytes()


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

    def open_channel() -> ChannelReceiver:
        job_barrier("channel-open")
        return ChannelReceiver(
            topo.rank, mine, topo.sender_ranks, ctx.device, compute_dtype(ctx.device), ctx.channel_device
        )

    stopped = train_drafter(ctx, run, open_channel)
    job_barrier("channel-closed")
    return stopped


def build_trainer(
    cfg: TrainConfig, setup: RunSetup, device: torch.device, total_steps: int, group=None
) -> DrafterTrainer:
    """A freshly initialised drafter with the target's shared head, AdamW and the schedule, as configured."""
    head = SharedTargetHead.from_target(setup.info).to(device=device, dtype=compute_dtype(device))
    drafter = build_drafter(setup.drafter_config, cfg.seed, device)
    drafter.gradient_checkpointing = setup.memory.checkpointing
    settings = step_settings(cfg, resolve_attention(cfg.attention, device))
    return DrafterTrainer(drafter, head, settings, optimizer_settings(cfg, total_steps), group)


def step_settings(cfg: TrainConfig, attention: str) -> StepSettings:
    """What a drafter step reads of the run's config (`attention`: the resolved kernel)."""
    loss = LossSettings(
        weighting=cfg.position_weighting,
        gamma=cfg.loss_gamma,
        dpace_smoothing=cfg.dpace_smoothing,
        loss=cfg.loss,
        ce_weight=cfg.ce_weight,
        chunk_rows=cfg.loss_chunk_size,
    )
    return StepSettings(
        cfg.num_anchors,
        cfg.seed,
        cfg.max_grad_norm,
        attention,
        cfg.drafter_chunk_tokens,
        loss,
        loss_gamma_start=cfg.loss_gamma_start,
        anchor_rule=cfg.anchor_rule,
    )


def optimizer_settings(cfg: TrainConfig, total_steps: int) -> OptimizerSettings:
    """The optimizer and schedule of the run's config over `total_steps`."""
    return OptimizerSettings(
        cfg.learning_rate, cfg.weight_decay, cfg.warmup_ratio, total_steps, cfg.optimizer
    )


def restore(run: Run, trainer: DrafterTrainer, drafter_index: int) -> int:
    """Load weights, optimizer, scheduler and RNG from the resume checkpoint; returns tokens seen.

    The RNG file is chosen by the rank's index among the drafter ranks, not its global rank: a resume with
    another number of target ranks moves the drafters' global ranks. Any failure is a RestoreError."""
    path = run.resume_from
    try:
        load_weights(path, trainer.drafter)
        trainer.optimizer.load_state_dict(read_tensor_file(path, "optimizer.pt"))
        trainer.scheduler.load_state_dict(read_tensor_file(path, "scheduler.pt"))
        restore_rng(path, drafter_index)
        tokens_seen = int(load_trainer_state(path)["tokens_seen"])
    except (ValueError, KeyError, TypeError, RuntimeError) as e:  # a state that does not fit the objects
        raise RestoreError(f"cannot resume from {path}: {describe_error(e, with_type=False)}") from None
    # The loaded states carry the checkpoint's lr and weight decay; this run's settings win (they differ
    # only when the user accepted the change with --resume_override).
    cfg, scheduler = run.cfg, trainer.scheduler
    scheduler.base_lrs = [cfg.learning_rate for _ in scheduler.base_lrs]
    for group, schedule_fn in zip(trainer.optimizer.param_groups, scheduler.lr_lambdas, strict=True):
        group.update(initial_lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
        group["lr"] = cfg.learning_rate * schedule_fn(scheduler.last_epoch)
    trainer.global_step = run.start_step
    return tokens_seen


def check_batch(message: Message, item: ScheduledBatch, rank: int) -> Message:
    """Lockstep safety: the batch that arrived must be the one this rank's schedule says comes next."""
    if message.g != item.g or message.batch.sample_ids.tolist() != item.members:
        raise ChannelError(
            f"drafter rank {rank}: expected global batch {item.g} with samples {item.members[:8]}..., got batch "
            f"{message.g} with samples {message.batch.sample_ids.tolist()[:8]}... from rank {message.source}: "
            "the ranks disagree about the data (different --data files or settings per rank?)"
        )
    return message


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

    def metrics(self, trainer: DrafterTrainer, result, epoch: int, tokens_seen: int) -> dict:
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
        )
        return metrics


def trainer_state(run: Run, topo: Topology, step: int, epoch: int, tokens_seen: int) -> dict:
    """trainer_state.json of the checkpoint of `step`: the run's identity, the data cursor and the topology."""
    return run.identity | {
        "global_step": step,
        "total_steps": run.schedule.total_steps,  # how an evaluation watcher knows the run's end
        "epoch": epoch,
        "batches_consumed": run.first_batch + (step - run.start_step) * run.schedule.batches_per_step,
        "tokens_seen": tokens_seen,
        "topology": {
            "world_size": topo.world_size,
            "target_ranks": topo.num_targets,
            "target_tp_size": topo.tp_size,
            "drafter_ranks": topo.num_drafters,
            "colocated": topo.colocated,
        },
    }


def train_drafter(ctx: DistributedContext, run: Run, open_source) -> bool:
    """The drafter's loop: take A micro-batches, one optimizer step, log and save on the leader.

    `open_source()` gives the batches (the channel, or the target in this process); it is called once the
    drafter is built, restored and, in a split job, warmed up.

    On SIGTERM/SIGINT every drafter rank finishes the step it is in, the leader saves, the targets are
    told to stop and the channel is drained. Returns whether the run stopped early."""
    topo, device, cfg, schedule = ctx.topology, ctx.device, run.cfg, run.schedule
    out = Path(cfg.output_dir)
    group = ctx.drafter_group if topo.num_drafters > 1 else None
    trainer = build_trainer(cfg, run.setup, device, schedule.total_steps, group)
    tokens_seen = restore(run, trainer, topo.drafter_ranks.index(topo.rank)) if run.resume_from else 0
    if not topo.colocated:
        trainer.warm_up()
    source = open_source()
    monitor = (
        TrainingMonitor(out, schedule.total_steps, run.start_step, run.trackers) if topo.is_leader else None
    )
    protect = {run.resume_from.name} if run.resume_from else set()
    writer = CheckpointWriter(out, cfg.save_total_limit, protect, monitor.print) if monitor else None
    window = LoggingWindow(source, topo.num_drafters, device)
    stop, stopping = GracefulStop().install(), False
    # signals delivered to other ranks (a target node's preemption) reach the leader through the store
    requests = StopFlag() if topo.is_leader and not topo.colocated else None
    expected = (
        item
        for item in schedule.batches(run.first_batch, run.end_batch)
        if topo.drafter_of(item.g) == topo.rank
    )
    try:
        for step in range(run.start_step + 1, schedule.total_steps + 1):
            if writer:
                writer.check()  # a failed background save stops the run now, not at the next save
            messages = [
                check_batch(source.get(), next(expected), topo.rank)
                for _ in range(cfg.gradient_accumulation_steps)
            ]
            if not topo.colocated:
                window.senders.update({m.source: (m.sender_wait_s, m.sender_inflight) for m in messages})
            step_start = time.perf_counter()
            result = trainer.step([(m.batch, m.features, m.epoch, m.soft) for m in messages])
            window.compute_s += time.perf_counter() - step_start
            # One all-reduce carries the step's tokens and whether any drafter rank was asked to stop,
            # so that every drafter rank stops after the same step.
            requested_by = stop.signal_name or (requests.requested() if requests else "")
            step_tokens, stop_votes = trainer.sum_over_drafters(
                torch.tensor([float(sum(m.batch.num_tokens for m in messages)), float(bool(requested_by))])
            ).tolist()
            stopping = stop_votes > 0
            tokens_seen += int(step_tokens)
            window.tokens += step_tokens
            if step % cfg.logging_steps == 0 or step == schedule.total_steps:
                metrics = window.metrics(trainer, result, messages[-1].epoch, tokens_seen)
                if monitor:
                    monitor.log(metrics)
                window.restart()
            saving = step % cfg.save_steps == 0 or step == schedule.total_steps or stopping
            rng_states = drafter_rng_states(group) if saving else {}  # every drafter rank takes part
            if saving:
                trainer.check_finite()  # never a checkpoint of weights a non-finite step touched
            if writer and saving:
                state = trainer_state(run, topo, step, messages[-1].epoch, tokens_seen)
                writer.save(step, trainer.drafter, trainer.optimizer, trainer.scheduler, state, rng_states)
            if stopping:
                if monitor:
                    monitor.print(
                        f"stop requested ({requested_by or 'on another drafter rank'}): stopped after step {step}"
                    )
                break
        if stopping:
            source.drain()
            if group is not None:  # every drafter rank drops incoming batches before any target stops
                dist.barrier(group=group)
            if requests is not None:  # the drafter leader of a split job: the targets stop
                requests.set()
        source.close()
        if writer:
            writer.wait()  # the last checkpoint is on disk before the job reports success
            monitor.print(f"checkpoint saves paused training for {writer.stall_s:.2f} s in total")
    finally:
        if writer:
            writer.wait(raise_error=False)
        if monitor:
            monitor.close()
    return stopping
