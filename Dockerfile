# dflash_ddp on a CUDA PyTorch base: torch comes from the image, the rest from PyPI.
#   docker build -t dflash_ddp .
#   docker run --gpus all --ipc=host -v /models:/models -v /data:/data -v $PWD/runs:/app/runs dflash_ddp \
#       --config configs/qwen3-8b.yaml
FROM pytorch/pytorch:2.9.1-cuda12.8-cudnn9-runtime

WORKDIR /app
COPY pyproject.toml README.md ./
COPY dflash_ddp ./dflash_ddp
COPY configs ./configs
COPY launch ./launch
# torch is already in the image; pip keeps it because it satisfies the requirement.
RUN pip install --no-cache-dir -e .

ENV PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
ENTRYPOINT ["python", "-m", "dflash_ddp.train"]
