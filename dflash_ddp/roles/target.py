"""A target rank's loop: compute the tapped features (and soft targets) of its group's batches and send them
to their drafter."""

from __future__ import annotations

import torch
import torch.distributed as dist

from dflash_ddp.data.batch import padding_id
from dflash_ddp.parallel.channel import ChannelSender
from dflash_ddp.parallel.meshes import tp_group
from dflash_ddp.parallel.signals import GracefulStop, StopFlag
from dflash_ddp.parallel.topology import DistributedContext, job_barrier
from dflash_ddp.setup.run import Run
from dflash_ddp.setup.target import build_extractor


def run_target(ctx: DistributedContext, run: Run) -> bool:
    """A target rank: compute the tapped features of its group's batches (g = group mod G) and, on the
    group's first rank, send each to its drafter.

    The drafter leader decides when the job stops: a signal here is passed on to it (through the job's
    store), and the loop ends early when the leader, having saved, raises the stop flag. The ranks of a
    tensor-parallel group agree before each batch, since a rank that left alone would leave the others
    waiting in the batch's all-reduces."""
    topo = ctx.topology
    stop, told = StopFlag(), False
    extractor = build_extractor(run.cfg, run.setup, ctx.device, ctx.target_meshes)
    sends = topo.rank in topo.sender_ranks
    sender = ChannelSender(topo.rank, run.cfg.max_inflight, ctx.channel_device) if sends else None
    group = tp_group(ctx.target_meshes) if ctx.target_meshes is not None else None
    pad_id = padding_id(run.setup.tokenizer)
    job_barrier("channel-open")  # every drafter rank has built, restored and warmed up its drafter
    # caught from here, as the drafter does after its warm-up: a signal while the target loads or waits for
    # the drafters ends the rank at once (nothing is trained yet), instead of waiting for the first batch
    signalled = GracefulStop().install()
    for item in run.schedule.batches(run.first_batch, run.end_batch):
        if topo.group_of(item.g) != topo.group:
            continue
        if signalled.requested and not told:  # e.g. a scheduler preempting only this node
            stop.request(f"{signalled.signal_name} on rank {topo.rank}")
            told = True
        if group_agrees_to_stop(stop.is_set(), group):
            break
        batch = run.data.batch(item.members, pad_id)
        features, soft = extractor(batch.input_ids.to(ctx.device), batch.attention_mask.to(ctx.device))
        if sender:
            sender.send(topo.drafter_of(item.g), batch, features, item.g, item.epoch, soft)
    if sender:
        sender.close(topo.drafter_ranks)
    job_barrier("channel-closed")  # every drafter rank has received its END: nothing is left in flight
    return False


def group_agrees_to_stop(stop: bool, group) -> bool:
    """Whether any rank of this tensor-parallel group saw the stop flag (each rank alone without one)."""
    if group is None:
        return stop
    flag = torch.tensor([int(stop)])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())
