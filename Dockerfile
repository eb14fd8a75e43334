# dflash_ddp in one image, built the same way for GPUs and for CPUs; only the build arguments differ.
#
# GPU (the default): a CUDA devel base with a C compiler (Triton compiles flex attention's launchers with gcc
# against Python.h at run time, which a runtime image lacks) and the CUDA 12.8 wheel of the tested torch.
#   docker build -t dflash_ddp .
#   launch/docker_run.sh --config configs/qwen3-8b.yaml   (= torchrun --nproc-per-node <GPUs> -m dflash_ddp.train ...)
# CPU: any Debian or Ubuntu image with Python 3.11+ (or one apt can install it into), torch from pip's own
# configured indexes. launch/docker_check.sh builds and runs it this way with buildah, no Docker daemon needed.
#   docker build -t dflash_ddp:cpu --build-arg BASE_IMAGE=debian:bookworm --build-arg TORCH_INDEX_URL= .
ARG BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-devel-ubuntu24.04
FROM ${BASE_IMAGE}
# PyTorch's wheel index for torch (CUDA 12.8 by default); empty: pip's own configured indexes.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128

ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential python3 python3-dev python3-venv \
 && rm -rf /var/lib/apt/lists/*

# The system Python is externally managed (PEP 668): everything goes into one virtual environment.
ENV VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH
RUN python3 -m venv /opt/venv && pip install --no-cache-dir --upgrade pip
RUN pip install --no-cache-dir "torch==2.13.0" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}

WORKDIR /app
# What the package needs at run time (tests/test_docker.py keeps this list in step with the package).
COPY pyproject.toml README.md ./
COPY dflash_ddp ./dflash_ddp
COPY configs ./configs
COPY launch ./launch
# torch is already installed; pip keeps it because it satisfies the requirement.
RUN pip install --no-cache-dir -e .

# Hub names resolve through the cache at HF_HOME (a volume: launch/docker_run.sh mounts the host's); set
# HF_HUB_OFFLINE=1 at run time to read that cache only.
ENV PYTHONUNBUFFERED=1 HF_HOME=/root/.cache/huggingface
# One process per visible GPU (without GPUs: NPROC CPU processes, 2 unless set); the last --drafter_ranks
# ranks train the drafter (7+1 on 8 GPUs).
ENTRYPOINT ["bash", "launch/single_node.sh"]
