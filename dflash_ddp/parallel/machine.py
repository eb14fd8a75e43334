"""What this machine holds, and whether a run's predicted peaks fit it: a device's capacity, the host's
memory, a process's resident baseline and peak. On a CPU the ranks of a node share its RAM, so the
check adds them up; on GPUs each rank has its own device.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

GIB = 1 << 30


CUDA_RESERVE = 2 * GIB  # CUDA context, allocator caching and fragmentation, outside the tensors counted here


@dataclass
class MemoryPlan:
    """Bytes by component for one rank; `total` is the predicted peak. `lasting`: the parts held the whole
    run (weights and optimizer state), against the transient ones of a step."""

    parts: dict[str, int]
    lasting: tuple[str, ...] = ()

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def describe(self) -> str:
        return ", ".join(f"{name} {size / GIB:.2f}" for name, size in self.parts.items() if size) + " GiB"


def process_baseline() -> int:
    """This process's resident memory now (the runtime and libraries every rank carries on a CPU)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_resident_bytes() -> int:
    """This process's own peak resident memory (VmHWM of /proc/self/status; ru_maxrss off Linux).

    Not getrusage's ru_maxrss on Linux: a process started by another one (subprocess, pytest) inherits its
    starter's high-water mark through fork and exec, so a small run started from a 1 GiB process reports
    at least 1 GiB (the measured-peak test read 1.11 GiB inside the test suite for a 0.73 GiB run)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:  # pragma: no cover - not Linux
        pass
    import resource  # pragma: no cover

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # pragma: no cover


def available_host_memory() -> int:
    """MemAvailable of this machine, plus what this process already holds."""
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["MemAvailable"].split()[0]) * 1024 + process_baseline()


@dataclass
class FitCheck:
    """What a node must hold and what it has; `fits` decides whether the run may start."""

    needed: int
    available: int
    where: str

    @property
    def fits(self) -> bool:
        return self.needed <= self.available


def check_fit(
    drafter: MemoryPlan,
    target: MemoryPlan,
    node_roles: list[str],
    device: torch.device,
    gpu_bytes: int | None = None,
) -> FitCheck:
    """Whether the ranks of this node fit: on a CPU all of them in one RAM, each with the runtime's own
    baseline; on GPUs the larger rank against one device's memory. `node_roles`: target, drafter or
    colocated, one per rank of the node. `gpu_bytes`: judge against GPUs of that memory instead (a plan
    made for another machine)."""
    # colocated: the target's forward ends before the drafter's step begins, so only the target's weights
    # and the larger of the two transient parts add up
    state = sum(drafter.parts[name] for name in drafter.lasting)
    colocated = target.parts["weights"] + max(drafter.total, target.total - target.parts["weights"] + state)
    sizes = {"target": target.total, "drafter": drafter.total, "colocated": colocated}
    if gpu_bytes is not None:
        usable = gpu_bytes - CUDA_RESERVE
        where = f"a {gpu_bytes / GIB:.3g} GiB GPU ({usable / GIB:.1f} GiB usable)"
        return FitCheck(max(sizes[r] for r in node_roles), usable, where)
    if device.type == "cuda":
        usable, where = device_capacity(device)
        return FitCheck(max(sizes[r] for r in node_roles), usable, where)
    needed = sum(sizes[r] for r in node_roles) + len(node_roles) * process_baseline()
    available = available_host_memory()
    ranks = f"{len(node_roles)} processes in " if len(node_roles) > 1 else ""
    return FitCheck(needed, available, f"{ranks}this machine's RAM ({available / GIB:.1f} GiB available)")


def device_capacity(device: torch.device) -> tuple[int, str]:
    """Bytes one process may use on `device` (a GPU's memory less CUDA_RESERVE, or this machine's available
    RAM) and their description for messages."""
    if device.type == "cuda":
        usable = torch.cuda.get_device_properties(device).total_memory - CUDA_RESERVE
        return usable, f"one {torch.cuda.get_device_name(device)} ({usable / GIB:.1f} GiB usable)"
    available = available_host_memory()
    return available, f"this machine's RAM ({available / GIB:.1f} GiB available)"
