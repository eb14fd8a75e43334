"""Interrupted jobs continue exactly where they stopped: SIGKILL, a change of target ranks, SIGTERM,
torchrun restarts. Real torchrun processes on CPU/gloo."""

import json
import os
import runpy
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import kill_job, one_thread, torchrun_cmd, train_colocated, train_flags

STEPS = 24


def train_args(tiny_target, chat_data, out, **overrides):
    settings = {"max_steps": STEPS, "save_steps": 4, "seed": 3, "dist_timeout": 60} | overrides
    return ["-m", "dflash_ddp.train", *train_flags(tiny_target, chat_data, out, **settings)]


def torchrun(nproc, args, *extra):
    return [*torchrun_cmd(nproc, *extra), *args]


def weights(out: Path) -> dict:
    return load_file(out / "checkpoints" / f"step-{STEPS:08d}" / "model.safetensors")


def metrics(out: Path) -> list[dict]:
    keep = ("step", "loss", "accuracy", "tau_estimate", "grad_norm", "lr", "tokens_seen", "epoch")
    return [
        {k: r[k] for k in keep} for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
    ]


def assert_same_run(a: Path, b: Path):
    wa, wb = weights(a), weights(b)
    assert all(torch.equal(wa[k], wb[k]) for k in wa), "final weights differ"
    assert metrics(a) == metrics(b)


def reference(tiny_target, chat_data, tmp_path_factory, cache={}):  # noqa: B006 - one uninterrupted run per session
    """The uninterrupted run, colocated in this process: a split job trains it bit for bit, the same losses and
    weights (test_split_jobs_train_bit_identical_drafters in test_distributed.py), so every interrupted job
    below, whatever its split, must end exactly where it ends."""
    if "out" not in cache:
        out = tmp_path_factory.mktemp("reference") / "run"
        train_colocated(train_args(tiny_target, chat_data, out))
        cache["out"] = out
    return cache["out"]


def wait_for_checkpoint(out: Path, step: int, job: subprocess.Popen, timeout=120):
    deadline = time.time() + timeout
    while not (out / "checkpoints" / f"step-{step:08d}").exists():
        assert job.poll() is None and time.time() < deadline, "the job ended or stalled before the checkpoint"
        time.sleep(0.05)


@pytest.mark.processes
def test_sigkill_then_resume_is_bit_identical(tiny_target, chat_data, tmp_path, tmp_path_factory):
    """A 2+1 job killed after its step-8 checkpoint (every process, without warning) and started again ends
    with the uninterrupted run's metrics and weights: the resume crosses an epoch (12 batches) boundary."""
    ref = reference(tiny_target, chat_data, tmp_path_factory)
    out = tmp_path / "run"
    job = subprocess.Popen(
        torchrun(3, train_args(tiny_target, chat_data, out)),
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_for_checkpoint(out, 8, job)
    kill_job(job)  # every process of the job, without warning
    assert not (out / "checkpoints" / f"step-{STEPS:08d}").exists()
    result = subprocess.run(
        torchrun(3, train_args(tiny_target, chat_data, out)), capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resuming from" in result.stdout
    assert_same_run(out, ref)


@pytest.mark.processes
def test_sigterm_saves_exits_0_and_resumes_as_2_plus_1(tiny_target, chat_data, tmp_path, tmp_path_factory):
    """A 3+1 job stopped with SIGTERM saves the step it was at; resumed as 2+1 it ends like the 3+1 run."""
    ref = reference(tiny_target, chat_data, tmp_path_factory)
    out = tmp_path / "run"
    job = subprocess.Popen(
        torchrun(4, train_args(tiny_target, chat_data, out, save_steps=1000)),
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.time() + 120
    while not (out / "metrics.jsonl").exists() or len((out / "metrics.jsonl").read_text().splitlines()) < 5:
        assert time.time() < deadline and job.poll() is None
        time.sleep(0.05)
    workers = [
        int(p)
        for p in subprocess.run(["pgrep", "-P", str(job.pid)], capture_output=True, text=True).stdout.split()
    ]
    for pid in workers:  # what torchrun does with a SIGTERM it receives: forward it to every worker
        os.kill(pid, signal.SIGTERM)
    output = job.communicate(timeout=60)[0]
    assert job.returncode == 0, output[-3000:]
    saved = sorted((out / "checkpoints").glob("step-*"))
    assert len(saved) == 1
    stopped_at = int(saved[0].name.split("-")[1])
    assert 5 <= stopped_at < STEPS and f"stopped after step {stopped_at}" in output
    assert len((out / "metrics.jsonl").read_text().splitlines()) == stopped_at  # no step lost, none extra
    result = subprocess.run(
        torchrun(3, train_args(tiny_target, chat_data, out)), capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "saved as 3+1, now 2+1" in result.stdout
    assert_same_run(out, ref)


@pytest.mark.processes
def test_torchrun_restarts_after_a_killed_target_rank_and_finishes_identically(
    tiny_target, chat_data, tmp_path, tmp_path_factory
):
    """Target rank 1 of a 2+1 job killed after the step-8 checkpoint: torchrun restarts every worker, which
    resume from the checkpoint and end with the uninterrupted run's metrics and weights."""
    ref = reference(tiny_target, chat_data, tmp_path_factory)
    out = tmp_path / "run"
    job = subprocess.Popen(
        torchrun(3, train_args(tiny_target, chat_data, out), "--max-restarts", "1"),
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    wait_for_checkpoint(out, 8, job)
    target = next(
        int(p)
        for p in subprocess.run(["pgrep", "-P", str(job.pid)], capture_output=True, text=True).stdout.split()
        if b"RANK=1\0" in Path(f"/proc/{p}/environ").read_bytes()
    )
    os.kill(target, signal.SIGKILL)
    output = job.communicate(timeout=300)[0]
    assert job.returncode == 0, output[-3000:]
    assert "resuming from" in output
    assert_same_run(out, ref)


@pytest.mark.processes
def test_fewer_drafter_ranks_keep_the_global_batch(tiny_target, chat_data, tmp_path):
    """A 2+2 job killed and resumed as 1+1 accumulates 2 batches per step: same global batch, same model
    (the model of one drafter accumulating 2 batches, trained here colocated, in this process: an
    uninterrupted 1+2 job trains it too, test_two_drafter_ranks_match_one_with_twice_the_batch)."""

    args = {"max_steps": 12, "save_steps": 4}
    ref = tmp_path / "ref"
    train_colocated(train_args(tiny_target, chat_data, ref, gradient_accumulation_steps=2, **args))
    out = tmp_path / "run"
    job = subprocess.Popen(
        torchrun(4, train_args(tiny_target, chat_data, out, drafter_ranks=2, **args)),
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_for_checkpoint(out, 4, job)
    kill_job(job)
    result = subprocess.run(
        torchrun(2, train_args(tiny_target, chat_data, out, **args)), capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (
        "keeping the checkpoint's global batch of 2 batches: 1 drafter rank(s) x --gradient_accumulation_steps 2"
        in result.stdout
    )
    a = load_file(ref / "checkpoints" / "step-00000012" / "model.safetensors")
    b = load_file(out / "checkpoints" / "step-00000012" / "model.safetensors")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)


@pytest.mark.processes
def test_every_drafter_rank_resumes_from_a_run_directory_given_to_resume(tiny_target, chat_data, tmp_path):
    """`--resume RUN_DIR` names the checkpoint its `latest` points at: the drafter ranks beside the leader
    read that one too (they read the directory itself and refused to start)."""
    first, second = tmp_path / "first", tmp_path / "second"
    args = {"drafter_ranks": 2, "save_steps": 2}
    done = subprocess.run(
        torchrun(3, train_args(tiny_target, chat_data, first, max_steps=2, **args)),
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    more = train_args(tiny_target, chat_data, second, max_steps=3, **args)
    more += ["--resume", str(first), "--resume_override", "max_steps"]
    resumed = subprocess.run(torchrun(3, more), capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout and (second / "checkpoints" / "step-00000003").is_dir()


@pytest.mark.processes
def test_a_second_ctrl_c_ends_the_process_at_once_a_second_sigterm_does_not():
    code = (
        "import os, signal, sys, time\n"
        "from dflash_ddp.parallel.signals import GracefulStop\n"
        "stop = GracefulStop().install()\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "print('first signal noted:', stop.requested, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGTERM)  # SLURM and torchrun both send one: the save goes on\n"
        "time.sleep(0.2)\n"
        "print('second SIGTERM ignored', flush=True)\n"
        "os.kill(os.getpid(), signal.SIGINT)\n"
        "time.sleep(10)\n"
        "print('still running')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert result.stdout == "first signal noted: True\nsecond SIGTERM ignored\n"
    assert result.returncode == -signal.SIGINT


@pytest.mark.processes
def test_a_random_op_in_the_step_resumes_exactly_after_the_leader_changes_rank(
    tiny_target, chat_data, tmp_path, monkeypatch
):
    """Trained colocated (the drafter's generator on rank 0), then resumed as 2+1 (the leader on rank 2): its
    generator is restored by drafter index, so a step that draws random numbers continues the same stream.
    The colocated run is scripts/train_with_random_step.py run in this process, with one thread like
    torchrun's workers."""
    from dflash_ddp.drafter import trainer

    script = str(Path(__file__).parent / "scripts" / "train_with_random_step.py")
    ref = tmp_path / "ref"
    settings = {"max_steps": 6, "save_steps": 3}
    monkeypatch.setattr(trainer.DrafterTrainer, "step", trainer.DrafterTrainer.step)  # undone after the test
    monkeypatch.setattr(sys, "argv", [script, *train_args(tiny_target, chat_data, ref, **settings)[2:]])
    with one_thread(), pytest.raises(SystemExit) as done:
        runpy.run_path(script, run_name="__main__")
    assert done.value.code == 0
    out = tmp_path / "run"
    shutil.copytree(ref, out)
    shutil.rmtree(out / "checkpoints" / "step-00000006")
    (out / "checkpoints" / "latest").write_text("step-00000003\n")
    resumed = subprocess.run(
        torchrun(3, [script, *train_args(tiny_target, chat_data, out, **settings)[2:]]),
        capture_output=True,
        text=True,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "saved as 1+1, now 2+1" in resumed.stdout  # a colocated run counts as 1+1
    a = load_file(ref / "checkpoints" / "step-00000006" / "model.safetensors")
    b = load_file(out / "checkpoints" / "step-00000006" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a), "the resumed run drew other random numbers"


def test_a_training_step_draws_only_from_generators_that_resume_restores(
    tiny_target, chat_data, tmp_path, monkeypatch
):
    """Resume restores torch's CPU and CUDA generators (rng_state); Python's `random` and numpy's global
    generators are not saved, so a step must never draw from them (it would break resume equivalence)."""
    import random

    import numpy as np

    from dflash_ddp.checkpoint.writer import rng_state
    from dflash_ddp.drafter.trainer import DrafterTrainer
    from dflash_ddp.train import main

    assert set(rng_state()) == ({"torch", "cuda"} if torch.cuda.is_available() else {"torch"})
    unrestored = []
    original_step = DrafterTrainer.step

    def watched(self, micro_batches):
        before = (random.getstate(), np.random.get_state()[1].tobytes())
        metrics = original_step(self, micro_batches)
        if (random.getstate(), np.random.get_state()[1].tobytes()) != before:
            unrestored.append(self.global_step)
        return metrics

    monkeypatch.setattr(DrafterTrainer, "step", watched)
    assert main(train_args(tiny_target, chat_data, tmp_path / "run", max_steps=2)[2:]) == 0
    assert unrestored == [], f"steps {unrestored} drew from a generator that resume does not restore"
