"""Command lines and processes of small local torchrun jobs (used by the soak, the benchmarks and the tests)."""

from __future__ import annotations

import sys
from pathlib import Path

# A job small enough for a 2-core CI machine: one drafter layer, short sequences, small batches.
SMALL_JOB = {
    "num_draft_layers": 1,
    "block_size": 4,
    "num_anchors": 8,
    "max_seq_len": 128,
    "tokens_per_batch": 512,
    "logging_steps": 1,
}


def as_flags(settings: dict) -> list[str]:
    """`--key value` command-line flags of a settings dict, in its order."""
    return [x for key, value in settings.items() for x in (f"--{key}", str(value))]


def torchrun_cmd(nproc: int, *extra: str) -> list[str]:
    """`torchrun --nproc-per-node N` on this machine (standalone rendezvous unless --nnodes is given)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), *extra]
    return cmd if any(e.startswith("--nnodes") for e in extra) else [*cmd, "--standalone"]


def worker_pids(agent: int) -> dict[int, int]:
    """RANK -> pid of the worker processes of the torchrun agent `agent` (its children with RANK set)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            # the parent pid follows the state after the command name, which may itself hold ")"
            if int(stat.rsplit(")", 1)[1].split()[1]) != agent:
                continue
            env = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        found.update({int(v[5:]): int(entry.name) for v in env if v.startswith(b"RANK=")})
    return found
