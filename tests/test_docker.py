"""The Dockerfile stays in step with the package: every file the package reads at run time is copied into
the image, its entry point is there, it builds the GPU image with no build arguments, and nothing blocks hub
names at run time. (Building it: launch/docker_check.sh, see docs/gpu.md.)"""

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = (ROOT / "Dockerfile").read_text()


def instructions(name: str) -> list[str]:
    """The arguments of every `NAME ...` instruction (continuation lines joined)."""
    text = re.sub(r"\\\n", " ", DOCKERFILE)
    return [line.split(None, 1)[1] for line in text.splitlines() if line.split(None, 1)[:1] == [name]]


def copied_sources() -> list[str]:
    sources = []
    for args in instructions("COPY"):
        *srcs, _dest = shlex.split(args)
        sources += [s.rstrip("/") for s in srcs if not s.startswith("--")]
    return sources


def in_image(path: str, sources: list[str]) -> bool:
    return any(path == s or path.startswith(s + "/") or s == "." for s in sources)


def tracked(*paths: str) -> list[str]:
    out = subprocess.run(["git", "ls-files", *paths], cwd=ROOT, capture_output=True, text=True, check=True)
    return out.stdout.split()


@pytest.mark.processes
def test_every_file_of_the_package_is_copied_into_the_image():
    sources = copied_sources()
    package = tracked("dflash_ddp") or [
        str(p.relative_to(ROOT)) for p in (ROOT / "dflash_ddp").rglob("*") if p.is_file()
    ]
    assert any(p.endswith(".py") for p in package) and any("assets/" in p for p in package)
    missing = [p for p in package if not in_image(p, sources)]
    assert not missing, f"files of the package the image lacks (add them to the Dockerfile's COPY): {missing}"
    [readme] = re.findall(r'^readme = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    for needed in ("pyproject.toml", readme):  # `pip install -e .` reads both
        assert in_image(needed, sources), f"{needed} is not copied: pip install in the image fails"


def test_the_entry_point_and_what_it_starts_are_in_the_image():
    [entry] = instructions("ENTRYPOINT")
    script = next(arg for arg in json.loads(entry) if arg.endswith(".sh"))  # the exec form: a JSON list
    assert in_image(script, copied_sources()) and (ROOT / script).is_file()
    assert "-m dflash_ddp.train" in (ROOT / script).read_text()
    assert "device_count() or 2" in (ROOT / script).read_text()  # without GPUs: 2 CPU processes, not 8


def test_no_build_arguments_give_the_gpu_image_and_hub_names_are_not_blocked():
    args = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in instructions("ARG") if "=" in a}
    assert args["BASE_IMAGE"].startswith("nvidia/cuda:") and "devel" in args["BASE_IMAGE"]
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cu128"
    assert instructions("FROM") == ["${BASE_IMAGE}"]
    env = " ".join(instructions("ENV"))
    assert "HF_HUB_OFFLINE" not in env, "HF_HUB_OFFLINE baked into the image blocks hub names"
    assert "HF_HOME=" in env


@pytest.mark.processes
def test_docker_run_keeps_the_checkpoints_on_the_host(tmp_path):
    """With a stand-in `docker` that prints its arguments: an --output_dir outside the one mounted folder is
    refused (the container's --rm would delete its checkpoints); OUT_DIR mounts another host folder; NPROC
    passes through."""
    fake = tmp_path / "docker"
    fake.write_text('#!/bin/sh\necho "docker $*"\n')
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "NPROC": "4", "OUT_DIR": "/shared/runs"}
    script = str(ROOT / "launch" / "docker_run.sh")
    for flags in (["--output_dir", "/scratch/q"], ["--output_dir=elsewhere/q"]):
        done = subprocess.run(["bash", script, *flags], env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and "is not under runs/" in done.stderr and not done.stdout
    for accepted in ("runs/q", "./runs/q", "--output_dir=runs"):
        flags = [accepted] if accepted.startswith("--") else ["--output_dir", accepted]
        done = subprocess.run(["bash", script, *flags], env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
    assert "-e NPROC " in done.stdout and "-v /shared/runs:/app/runs " in done.stdout
