"""The launch files: one torch version everywhere, and launch/gpu_check.sh run for real on the CPU."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import side_by_side

ROOT = Path(__file__).resolve().parents[1]
GPU_CHECK = ROOT / "launch" / "gpu_check.sh"
STEPS = [
    "preflight",
    "colocated_flex",
    "gpu_shapes",
    "plan_large",
    "large",
    "split_gloo",
    "dflash2_window",
    "dspark",
    "plan_long_context",
    "long_context",
    "colocated_sparse",
    "regenerate",
]


def run_gpu_check(out: Path, *args: str, env: dict | None = None, timeout: float = 600):
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, **(env or {})}
    return subprocess.run(
        ["bash", str(GPU_CHECK), *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def summary_lines(out: Path) -> dict[str, str]:
    """First word of each line of summary.txt -> the rest of the line."""
    lines = (out / "summary.txt").read_text().splitlines()
    return {line.split()[0]: line for line in lines if line.strip()}


def test_torch_version_is_the_same_in_dockerfile_readme_pyproject_and_preflight():
    docker = re.findall(r"torch==(\d+\.\d+\.\d+)", (ROOT / "Dockerfile").read_text())
    readme = re.findall(r'pip install "torch==(\d+\.\d+\.\d+)"', (ROOT / "README.md").read_text())
    lower = re.findall(r'"torch([^"]*)"', (ROOT / "pyproject.toml").read_text())
    preflight = re.findall(r"version < \((\d+), (\d+)\)", GPU_CHECK.read_text())
    assert len(docker) == 1 and len(readme) == 1, (docker, readme)
    assert docker == readme, f"Dockerfile pins torch {docker[0]}, the README's install line {readme[0]}"
    minor = ".".join(docker[0].split(".")[:2])
    assert lower == [f">={minor}"], f"pyproject requires torch{lower}, the pin is {docker[0]}"
    assert preflight == [tuple(minor.split("."))], f"gpu_check.sh's preflight checks {preflight}"


def test_ci_runs_the_readmes_test_command():
    """CI checks what a new user runs: .ci/run's pytest line is the README's, flags and all (the two
    workers the conftest's grouping is for)."""
    readme = re.findall(r"^python -m pytest.*$", (ROOT / "README.md").read_text(), re.M)
    ci = re.findall(r"^python -m pytest.*$", (ROOT / ".ci" / "run").read_text(), re.M)
    assert len(readme) == 1 and readme == ci, (readme, ci)
    assert "-n 2 --dist loadgroup" in readme[0]


@pytest.mark.processes  # the inner marked test's
def test_a_test_that_starts_a_process_unmarked_fails_naming_the_mark(pytester):
    """The grouping holds only while every process-starting test is marked: an unmarked one fails before its
    process starts (it would run beside the jobs), a marked one runs."""
    pytester.makeconftest((ROOT / "tests" / "conftest.py").read_text())
    pytester.makepyfile(
        test_inner="""
        import subprocess, sys
        import pytest

        def test_unmarked():
            subprocess.run([sys.executable, "-c", "pass"], check=True)

        @pytest.mark.processes
        def test_marked():
            subprocess.run([sys.executable, "-c", "pass"], check=True)
        """
    )
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*test_unmarked starts a process: mark it `@pytest.mark.processes`*"])


@pytest.mark.processes
def test_gpu_check_parses():
    subprocess.run(["bash", "-n", str(GPU_CHECK)], check=True)


@pytest.mark.processes
def test_gpu_check_stops_after_a_failed_preflight(tmp_path):
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "torch.py").write_text("raise ImportError('no torch in this environment')\n")
    out = tmp_path / "out"
    result = run_gpu_check(out, "--dry-run", env={"PYTHONPATH": str(fake)}, timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    summary = summary_lines(out)
    assert "preflight FAILED: import torch: no torch in this environment" in summary["preflight"]
    assert "nothing else was run" in (out / "summary.txt").read_text()
    assert not set(STEPS[1:]) & set(summary)


@pytest.mark.processes
def test_gpu_check_times_out_a_hung_step(tmp_path):
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "torch.py").write_text("import time\nprint('hanging', flush=True)\ntime.sleep(600)\n")
    out = tmp_path / "out"
    result = run_gpu_check(out, "--dry-run", env={"PYTHONPATH": str(fake), "BUDGET_S": "6"}, timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "exit=124(timed-out)" in summary_lines(out)["preflight"]
    assert (out / "preflight.log").read_text() == "hanging\n"  # unbuffered: the log holds the output


# The dry run's steps in two lanes run side by side (most steps are one single-threaded process: a core
# each), each lane a run of the script with ONLY= naming its steps; a step that reads another's output
# (split_gloo colocated_flex's losses, large and long_context their plans) is in that step's lane
LANES = (
    ["colocated_flex", "split_gloo", "gpu_shapes", "plan_large", "large"],
    ["dflash2_window", "dspark", "plan_long_context", "long_context", "colocated_sparse", "regenerate"],
)


@pytest.mark.processes
def test_gpu_check_dry_run_runs_every_step(tmp_path):
    assert sorted(["preflight", *LANES[0], *LANES[1]]) == sorted(STEPS)
    outs = [tmp_path / f"lane{i}" for i in range(len(LANES))]
    env = {**os.environ, "PYTHON": sys.executable}
    lanes = side_by_side(
        [["bash", str(GPU_CHECK), "--dry-run"]] * len(LANES),
        [{**env, "OUT": str(out), "ONLY": ",".join(steps)} for out, steps in zip(outs, LANES, strict=True)],
    )
    for lane in lanes:
        assert lane.returncode == 0, lane.stdout[-4000:] + lane.stderr[-4000:]
    summary = {}
    for out, steps in zip(outs, LANES, strict=True):
        lines = summary_lines(out)
        assert "exit=0 " in lines["preflight"], lines["preflight"]  # every run starts with its preflight
        summary.update({name: lines[name] for name in steps})
        assert all("not-asked(ONLY)" in lines[name] for name in STEPS if name not in ["preflight", *steps])
    for name in STEPS[1:]:
        assert "exit=0 " in summary[name], summary.get(name)
    for name in ("colocated_flex", "large", "colocated_sparse"):
        assert re.search(r"peak_gib=\d", summary[name]) and "tau_train=" in summary[name], summary[name]
    assert "s_per_step=" in summary["colocated_flex"] and "lossless=True" in summary["colocated_flex"]
    assert re.search(r"plan_gib=\d", summary["large"]) and "recompiles=0" in summary["large"]
    assert "lossless=True" in summary["dflash2_window"] and "recompiles=0" in summary["dflash2_window"]
    assert "lossless=True" in summary["dspark"] and "recompiles=0" in summary["dspark"]
    assert re.search(r"peak_gib=\d.*plan_gib=\d", summary["long_context"]), summary["long_context"]
    first, second = ((out / "summary.txt").read_text() for out in outs)
    assert "0 step(s) failed" in first and "0 step(s) failed" in second
    # the split job trains what the colocated one does (bit-identical on the CPU, one thread each)
    assert re.search(r"losses colocated vs 1\+1: steps \[1, 2\], max \|difference\| 0\.0\b", first), first
    assert (outs[1] / "regenerated.jsonl").is_file() and (outs[0] / "colocated_flex" / "eval.json").is_file()
    for out in outs:
        assert not list(out.glob("*/checkpoints")) and not (out / "compile_cache").exists()


@pytest.mark.processes
@pytest.mark.parametrize(
    "only,args,message",
    [
        ("split-gloo", ["--dry-run"], "ONLY names no step 'split-gloo'"),
        ("", ["--dry-run", "--only", "split_gloo"], "one option at most"),
    ],
)
def test_gpu_check_refuses_steps_it_would_not_run(tmp_path, only, args, message):
    """A misspelt step ran only the preflight and ended '0 step(s) failed'; an ignored argument ran every
    step: either spends a GPU lease on nothing asked for."""
    env = {**os.environ, "ONLY": only, "OUT": str(tmp_path / "out")}
    done = subprocess.run(
        ["bash", str(ROOT / "launch" / "gpu_check.sh"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.processes
def test_the_slurm_script_gives_srun_the_cpus_and_a_process_per_gpu(tmp_path):
    """Run with stand-ins for scontrol and srun that print what they are given, as SLURM would start it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho node-a; echo node-b\n")
    (bin_dir / "srun").write_text('#!/bin/sh\necho "srun $*"\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_NODELIST": "node-[a-b]",
        "SLURM_NNODES": "2",
        "SLURM_JOB_ID": "42",
        "SLURM_CPUS_PER_TASK": "16",
        "SLURM_GPUS_ON_NODE": "4",
    }
    done = subprocess.run(
        ["bash", str(ROOT / "launch" / "slurm_multinode.sbatch"), "--config", "configs/qwen3-8b.yaml"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    line = " ".join(done.stdout.split())
    assert line.startswith("srun --cpus-per-task 16 torchrun --nnodes 2 --nproc-per-node 4 --rdzv-id 42"), (
        line
    )
    assert "--rdzv-endpoint node-a:29500" in line and line.endswith(
        "-m dflash_ddp.train --config configs/qwen3-8b.yaml"
    )
