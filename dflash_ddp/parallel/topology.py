"""Who does what: the ranks' roles, their process groups, and which rank handles which global batch.

With world size W and `--drafter_ranks M`, ranks 0..W-M-1 run the frozen target and ranks W-M..W-1 train
one drafter data-parallel. With `--target_tp_size N` the T = W - M target ranks form G = T / N groups of N
consecutive ranks, each group one tensor-parallel copy of the target (N = 1: every target rank is a group).
Global batch g is computed by target group g mod G, sent by that group's first rank, and trained by drafter
rank g mod M; drafter optimizer step s consumes batches s*M*A .. (s+1)*M*A - 1, whatever G, N and M are.
W = 1 is the colocated case: one process does both.
"""

from __future__ import annotations

import datetime
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dflash_ddp.parallel.devices import select_device
from dflash_ddp.parallel.meshes import group_meshes


@dataclass(frozen=True)
class Topology:
    """The split of a job into target and drafter ranks (pure arithmetic, no process groups)."""

    world_size: int
    rank: int
    num_drafters: int
    tp_size: int = 1  # target ranks per tensor-parallel group

    def __post_init__(self):
        w, m, n = self.world_size, self.num_drafters, self.tp_size
        if w == 1:
            if m != 1:
                raise ValueError(
                    f"--drafter_ranks {m}: a single process trains one colocated drafter; pass 1"
                )
            if n != 1:
                raise ValueError(
                    f"--target_tp_size {n}: one process cannot shard the target; start {n} target ranks and "
                    f"the drafter's under torchrun (--nproc-per-node {n + 1} --drafter_ranks 1)"
                )
            return
        if m < 1:
            raise ValueError(
                f"--drafter_ranks {m}: with {w} processes at least one rank must train the drafter"
            )
        if m >= w:
            raise ValueError(
                f"--drafter_ranks {m}: with {w} processes at least one rank must run the target; "
                f"pass at most {w - 1}"
            )
        if (w - m) % n:
            raise ValueError(
                f"--target_tp_size {n} does not divide the {w - m} target ranks ({w} processes - {m} drafter "
                f"ranks): start {n} x groups + {m} processes, or pick a size that divides {w - m}"
            )

    @property
    def colocated(self) -> bool:
        return self.world_size == 1

    @property
    def num_targets(self) -> int:
        return 1 if self.colocated else self.world_size - self.num_drafters

    @property
    def target_ranks(self) -> list[int]:
        return [0] if self.colocated else list(range(self.num_targets))

    @property
    def num_groups(self) -> int:
        """Tensor-parallel target groups (each computes whole batches)."""
        return self.num_targets // self.tp_size

    def group_ranks(self, group: int) -> list[int]:
        """The target ranks of tensor-parallel group `group`."""
        return self.target_ranks[group * self.tp_size : (group + 1) * self.tp_size]

    @property
    def group(self) -> int:
        """This target rank's group."""
        return self.rank // self.tp_size

    @property
    def sender_ranks(self) -> list[int]:
        """The target ranks that send features: the first of each group."""
        return self.target_ranks[:: self.tp_size]

    @property
    def drafter_ranks(self) -> list[int]:
        return [0] if self.colocated else list(range(self.num_targets, self.world_size))

    @property
    def role(self) -> str:
        if self.colocated:
            return "colocated"
        return "target" if self.rank < self.num_targets else "drafter"

    @property
    def is_leader(self) -> bool:
        return self.rank == self.drafter_ranks[0]

    def group_of(self, g: int) -> int:
        """The target group that computes global batch g."""
        return g % self.num_groups

    def target_of(self, g: int) -> int:
        """The rank that sends global batch g's features (the first rank of the group computing it)."""
        return self.target_ranks[self.group_of(g) * self.tp_size]

    def drafter_of(self, g: int) -> int:
        """The rank that trains on global batch g."""
        return self.drafter_ranks[g % self.num_drafters]

    def describe(self) -> list[str]:
        """Lines for --plan: roles and who feeds whom."""
        if self.colocated:
            return ["colocated: one process runs the target and trains the drafter"]
        lines = [
            f"world size {self.world_size}: target ranks {self.target_ranks}, drafter ranks {self.drafter_ranks}"
            + (" (data-parallel drafter)" if self.num_drafters > 1 else ""),
            f"drafter leader (logs, saves): rank {self.drafter_ranks[0]}",
        ]
        groups = self.num_groups
        for k in range(groups):
            feeds = sorted({self.drafter_of(g) for g in range(k, k + groups * self.num_drafters, groups)})
            ranks = self.group_ranks(k)
            who = (
                f"target rank {ranks[0]}"
                if self.tp_size == 1
                else f"target group {k} (ranks {ranks[0]}-{ranks[-1]}, tensor-parallel {self.tp_size}; "
                f"rank {ranks[0]} sends)"
            )
            lines.append(f"{who} computes batches g = {k} mod {groups} and feeds drafter ranks {feeds}")
        return lines


@dataclass
class DistributedContext:
    """A running job's topology plus its process groups and device."""

    topology: Topology
    device: torch.device
    drafter_group: object | None  # process group of the drafter ranks (gradient all-reduce)
    channel_device: torch.device | None = None  # where the channel's tensors travel from (None: colocated)
    target_meshes: object | None = None  # the target groups' device meshes (--target_tp_size > 1)


def env_world() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun/accelerate's environment; (0, 1, 0) without it."""
    return (
        int(os.environ.get("RANK", 0)),
        int(os.environ.get("WORLD_SIZE", 1)),
        int(os.environ.get("LOCAL_RANK", 0)),
    )


def init_distributed(
    num_drafters: int,
    device_request: str,
    timeout_s: float,
    channel_backend: str = "auto",
    tp_size: int = 1,
) -> DistributedContext:
    """Join the job: NCCL on CUDA, gloo on CPU (the same code). Process groups are created on every rank.

    `channel_backend` "gloo" on GPUs: gloo only, no NCCL communicator at all; the channel stages features
    through host memory and ranks may share a GPU."""
    rank, world, local_rank = env_world()
    topology = Topology(world, rank, num_drafters, tp_size)
    device = select_device(device_request, local_rank, share_gpus=channel_backend == "gloo")
    nccl = device.type == "cuda" and channel_backend != "gloo"
    if topology.colocated:
        return DistributedContext(topology, device, None)
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(
        # NCCL for CUDA tensors; small CPU tensors (decisions, votes, metrics) need gloo beside it.
        backend="cpu:gloo,cuda:nccl" if nccl else "gloo",
        timeout=timeout,
        device_id=device if nccl else None,
        **_store_for_this_attempt(rank, world, timeout),
    )
    # new_group must be called by every rank, in the same order, even by ranks outside the group.
    drafter_group = dist.new_group(topology.drafter_ranks)
    meshes = group_meshes(topology.num_groups, tp_size, device.type) if tp_size > 1 else None
    return DistributedContext(
        topology, device, drafter_group, device if nccl else torch.device("cpu"), meshes
    )


def _store_for_this_attempt(rank: int, world: int, timeout: datetime.timedelta) -> dict:
    """Under torchrun, the agent's store with a prefix per restart attempt.

    After `torchrun --max-restarts` restarts the workers, the agent's store still holds the previous
    attempt's addresses (seen with torch 2.13), and gloo then tries to connect to processes that no
    longer exist. A prefix per attempt gives every attempt a clean namespace."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False, timeout=timeout
    )
    return {
        "store": dist.PrefixStore(f"dflash_ddp/attempt_{attempt}", store),
        "rank": rank,
        "world_size": world,
    }


def once_per_node(key: str, work: Callable[[str | None], str | None]) -> str | None:
    """Run `work(None)` on the first process of this node and `work(result)` on the others once it has
    finished: the hub downloads of a torchrun job happen once per node while the other ranks wait, then
    read the same snapshot (its commit is `result`). Before any process group exists, through torchrun's
    store; a process started without torchrun just runs `work(None)`. The first process's refusal is
    every process's."""
    rank, world, local_rank = env_world()
    store_args = _store_for_this_attempt(rank, world, datetime.timedelta(seconds=BARRIER_TIMEOUT_S))
    if not store_args:
        return work(None)
    store, key = store_args["store"], f"dflash_ddp/once/{os.environ.get('GROUP_RANK', '0')}/{key}"
    if local_rank == 0:
        try:
            result = work(None)
        except ValueError as e:
            store.set(key, json.dumps({"error": str(e)}))
            raise
        store.set(key, json.dumps({"result": result}))
        return result
    wait_for_key(
        store,
        key,
        BARRIER_TIMEOUT_S,
        lambda: (
            f"rank {rank}: the first process of this node did not "
            f"finish '{key}' (a download?) within {BARRIER_TIMEOUT_S:.0f} s"
        ),
    )
    published = json.loads(store.get(key))
    if "error" in published:
        raise ValueError(published["error"])
    return work(published["result"])


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


# How long a rank waits at the job's start and end barriers: loading the target, building and compiling the
# drafter, and the drafter's last steps all happen before them, so far beyond --dist_timeout (one transfer).
BARRIER_TIMEOUT_S = 3600.0
BARRIER_POLL_S = 0.1  # between looks at the store: a barrier ends at most this much after its last rank


def job_store() -> dist.Store:
    """The job's key-value store (torchrun's rendezvous store, which every rank of the job reaches): where
    barriers, stop requests and calibration figures pass without a collective."""
    return dist.distributed_c10d._get_default_store()


def job_barrier(name: str, timeout_s: float = BARRIER_TIMEOUT_S) -> None:
    """Wait until every rank of the job has arrived at barrier `name`, through the job's store: no
    collective, so no NCCL communicator and no watchdog is involved, and the wait has its own timeout. A
    rank still missing after `timeout_s` is named in the error. The store is polled from Python: a wait
    inside the store's C++ call would hold off Ctrl-C for as long as the other ranks take to load."""
    store = job_store()
    rank, world = dist.get_rank(), dist.get_world_size()
    store.set(f"dflash_ddp/barrier/{name}/rank{rank}", "1")
    if store.add(f"dflash_ddp/barrier/{name}/arrived", 1) == world:
        store.set(f"dflash_ddp/barrier/{name}/all", "1")

    def stuck() -> str:
        missing = [r for r in range(world) if not store.check([f"dflash_ddp/barrier/{name}/rank{r}"])]
        return (
            f"rank {rank}: ranks {missing} did not reach the {name} barrier within {timeout_s:.0f} s "
            "(stuck loading or compiling? see their output)"
        )

    wait_for_key(store, f"dflash_ddp/barrier/{name}/all", timeout_s, stuck)


def wait_for_key(store: dist.Store, key: str, timeout_s: float, message: Callable[[], str]) -> None:
    """Wait until `key` is set in `store`, polling from Python: a wait inside the store's C++ call would hold
    off Ctrl-C for as long as the other ranks take. TimeoutError with `message()` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not store.check([key]):
        if time.monotonic() > deadline:
            raise TimeoutError(message())
        time.sleep(BARRIER_POLL_S)
