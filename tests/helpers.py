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

import torch

from dflash_ddp.parallel.jobs import SMALL_JOB, as_flags, torchrun_cmd
from dflash_ddp.parallel.jobs import worker_pids as rank_pids

__all__ = [
    "SMALL_JOB",
    "file_size_limit",
    "kill_job",
    "rank_pids",
    "small_draft_config",
    "torchrun_cmd",
    "train_flags",
]


def small_draft_config(**overrides):
    """A drafter config small enough for exact CPU checks: 2 layers of width 32 (4 heads x 8, 2 KV heads),
    a 50-token vocabulary with mask id 49, taps [0, 2] of a 4-layer target, block size 4."""
    from dflash_ddp.drafter.config import DFlashDraftConfig

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


@contextlib.contextmanager
def one_thread():
    """One torch thread, as torchrun's workers have (OMP_NUM_THREADS=1): a matrix product can round
    differently when its sums are split over more threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def train_colocated(args: list[str]) -> None:
    """`python -m dflash_ddp.train` (`args` as `python -m dflash_ddp.train ...` takes them after the module,
    from its `-m dflash_ddp.train` on) colocated in this process, with one thread as torchrun's workers."""
    from dflash_ddp.train import main

    with one_thread():
        assert main(args[2:]) == 0


def train_flags(target, data, out, **settings) -> list[str]:
    """`--key value` flags of a small training job on `target`/`data` writing to `out`."""
    return as_flags({"target_model": target, "data": data, "output_dir": out, **SMALL_JOB, **settings})


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


# Runs in a fresh process: each forward's peak is its own (VmHWM reset after a warm-up forward), the
# targets one after another, each freed before the next
MEASURE_FORWARDS = """
import gc, sys, torch
from pathlib import Path
from dflash_ddp.parallel.machine import peak_resident_bytes
from dflash_ddp.target_model.features import TargetFeatureExtractor
from dflash_ddp.target_model.info import inspect_target
torch.set_num_threads(1)
rows, length = map(int, sys.argv[1:3])
ids, mask = torch.randint(4, 200, (rows, length)), torch.ones(rows, length, dtype=torch.long)
mask[1:, -10:] = 0  # rows after the first end early: padding
resident = lambda: int(Path("/proc/self/statm").read_text().split()[1]) * 4096
for target, taps, piece in zip(sys.argv[3::3], sys.argv[4::3], map(int, sys.argv[5::3])):
    taps = [int(t) for t in taps.split(",")]
    extractor = TargetFeatureExtractor(inspect_target(Path(target)), taps, torch.device("cpu"), torch.float32,
                                       prefill_tokens=piece)
    extractor(ids[:, :256], mask[:, :256])
    base = resident()
    Path("/proc/self/clear_refs").write_text("5")
    extractor(ids, mask)
    print(peak_resident_bytes() - base)
    del extractor
    gc.collect()
"""


def side_by_side(
    commands: list[list[str]], envs: list[dict] | None = None, timeout: float = 900
) -> list[subprocess.CompletedProcess]:
    """Run `commands` at once (each with its `envs` entry as its whole environment, else this one's) and
    wait for all: for independent single-threaded processes, a core each on a 2-core machine. Output
    captured as text."""
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    started = [
        subprocess.Popen(command, env=env, **pipes)
        for command, env in zip(commands, envs or [None] * len(commands), strict=True)
    ]
    done = []
    for command, process in zip(commands, started, strict=True):
        out, err = process.communicate(timeout=timeout)
        done.append(subprocess.CompletedProcess(command, process.returncode, out, err))
    return done


def forward_peaks_command(forwards: list[tuple[Path, list[int], int]], rows: int, length: int) -> list[str]:
    """A fresh process with one thread printing the bytes each target rank's forward (a target, its taps and
    its prefill's pieces) of a padded fp32 batch adds to its resident peak, one after another (Linux: the
    peak is reset after a warm-up); `measure_forward_peaks` runs it."""
    args = [sys.executable, "-c", MEASURE_FORWARDS, str(rows), str(length)]
    return args + [
        x for target, taps, piece in forwards for x in (str(target), ",".join(map(str, taps)), str(piece))
    ]


def measure_forward_peaks(commands: list[list[str]]) -> list[list[int]]:
    """The figures each `forward_peaks_command` printed, the commands run side by side (a process's peak is
    its own: one core each)."""
    # large blocks straight from and back to the system: the resident peak is the tensors', not the heap's
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    peaks = []
    for done in side_by_side(commands, [env] * len(commands)):
        assert done.returncode == 0, done.stderr[-3000:]
        peaks.append([int(line) for line in done.stdout.split()])
    return peaks


def target_forward_peaks(forwards: list[tuple[Path, list[int], int]], rows: int, length: int) -> list[int]:
    """`forward_peaks_command`'s figures, in two processes where there are two forwards or more."""
    halves = [forwards[0::2], forwards[1::2]] if len(forwards) > 1 else [forwards]
    peaks = measure_forward_peaks([forward_peaks_command(half, rows, length) for half in halves])
    # back in the order given: the halves took every other forward
    return [peaks[i % len(halves)][i // len(halves)] for i in range(len(forwards))]
