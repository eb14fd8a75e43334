# dflash_ddp on a CUDA base with a C compiler: Triton (flex attention, torch.compile) compiles its
# launchers with gcc against Python.h at run time, which a runtime image lacks. torch is the CUDA 12.8
# wheel of the tested version (docs/gpu.md); the rest comes from PyPI.
#   docker build -t dflash_ddp .
#   launch/docker_run.sh --config configs/qwen3-8b.yaml   (= torchrun --nproc-per-node <GPUs> -m dflash_ddp.train ...)
FROM nvidia/cuda:12.8.1-cudnn-devel-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential python3 python3-dev python3-venv \
 && rm -rf /var/lib/apt/lists/*

# Ubuntu 24.04's Python is externally managed (PEP 668): everything goes into one virtual environment.
ENV VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH
RUN python3 -m venv /opt/venv && pip install --no-cache-dir --upgrade pip
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128

WORKDIR /app
COPY pyproject.toml README.md ./
COPY dflash_ddp ./dflash_ddp
COPY configs ./configs
COPY launch ./launch
# torch is already installed; pip keeps it because it satisfies the requirement.
RUN pip install --no-cache-dir -e .

# Hub names resolve through the cache at HF_HOME (a volume: launch/docker_run.sh mounts the host's); set
# HF_HUB_OFFLINE=1 at run time to read that cache only.
ENV PYTHONUNBUFFERED=1 HF_HOME=/root/.cache/huggingface
# One process per visible GPU; the last --drafter_ranks ranks train the drafter (default 7+1 on 8 GPUs).
ENTRYPOINT ["bash", "launch/single_node.sh"]
