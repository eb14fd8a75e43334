"""Command lines shared by the tests that launch real training jobs."""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path


def small_draft_config(**overrides):
    """A drafter config small enough for exact CPU checks: 2 layers of width 32 (4 heads x 8, 2 KV heads),
    a 50-token vocabulary with mask id 49, taps [0, 2] of a 4-layer target, block size 4."""
    from dflash_ddp.model import DFlashDraftConfig

    settings = dict(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_target_layers=4,
        target_layer_ids=[0, 2],
        mask_token_id=49,
        block_size=4,
    )
    return DFlashDraftConfig(**{**settings, **overrides})


# A job small enough for a 2-core CI machine: one drafter layer, short sequences, small batches.
SMALL_JOB = {
    "num_draft_layers": 1,
    "block_size": 4,
    "num_anchors": 8,
    "max_seq_len": 128,
    "tokens_per_batch": 512,
    "logging_steps": 1,
}


def train_flags(target, data, out, **settings) -> list[str]:
    """`--key value` flags of a small training job on `target`/`data` writing to `out`."""
    merged = {"target_model": target, "data": data, "output_dir": out, **SMALL_JOB, **settings}
    return [x for key, value in merged.items() for x in (f"--{key}", str(value))]


def torchrun_cmd(nproc: int, *extra: str) -> list[str]:
    """`torchrun --nproc-per-node N` on this machine (standalone rendezvous unless --nnodes is given)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), *extra]
    return cmd if any(e.startswith("--nnodes") for e in extra) else [*cmd, "--standalone"]


def _running(pid: int) -> bool:
    """The process exists and is not a zombie (dead, waiting to be reaped)."""
    try:
        return ") Z " not in Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False


def kill_job(job: subprocess.Popen, timeout: float = 30) -> None:
    """SIGKILL a torchrun job started with start_new_session=True: the agent and every worker.

    torchrun (2.13) starts each worker in a session of its own, so killing the agent's process group
    leaves the workers running until their connections break; kill each one and wait until it is gone."""
    workers = [
        int(p)
        for p in subprocess.run(["pgrep", "-P", str(job.pid)], capture_output=True, text=True).stdout.split()
    ]
    for pid in [job.pid, *workers]:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
    job.wait()
    deadline = time.time() + timeout
    for pid in workers:
        while _running(pid):
            assert time.time() < deadline, f"worker {pid} survived SIGKILL"
            time.sleep(0.01)


def file_size_limit(nbytes: int):
    """A preexec_fn capping every file the child (and its children) writes at `nbytes` (RLIMIT_FSIZE).

    A write past the cap fails with EFBIG (Python ignores SIGXFSZ) the way a full disk fails with ENOSPC:
    Python raises OSError, torch.save RuntimeError, safetensors SafetensorError."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))

    return limit


def rank_pids(parent: int) -> dict[int, int]:
    """RANK -> pid of torchrun's worker processes."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
            ppid = int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))
            env = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, StopIteration):
            continue
        if ppid == parent:
            for var in env:
                if var.startswith(b"RANK="):
                    found[int(var[5:])] = int(entry.name)
    return found
