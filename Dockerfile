# dflash_ddp on a CUDA PyTorch base: torch comes from the image, the rest from PyPI.
#   docker build -t dflash_ddp .
#   launch/docker_run.sh --config configs/qwen3-8b.yaml   (= torchrun --nproc-per-node <GPUs> -m dflash_ddp.train ...)
FROM pytorch/pytorch:2.9.1-cuda12.8-cudnn9-runtime

WORKDIR /app
COPY pyproject.toml README.md ./
COPY dflash_ddp ./dflash_ddp
COPY configs ./configs
COPY launch ./launch
# torch is already in the image; pip keeps it because it satisfies the requirement.
RUN pip install --no-cache-dir -e .

ENV PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
# One process per visible GPU; the last --drafter_ranks ranks train the drafter (default 7+1 on 8 GPUs).
ENTRYPOINT ["bash", "launch/single_node.sh"]
