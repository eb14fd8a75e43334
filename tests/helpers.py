"""Command lines shared by the tests that launch real training jobs."""

from __future__ import annotations

import sys

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
