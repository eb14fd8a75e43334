#!/usr/bin/env bash
# Run the job in the image built from the Dockerfile, on every GPU of this machine.
#   docker build -t dflash_ddp . && launch/docker_run.sh --config configs/qwen3-8b.yaml
# Mount your model and data directories where the config expects them (/models, /data); checkpoints land
# in ./runs on the host.
set -euo pipefail
# `docker stop` waits --stop-timeout seconds before SIGKILL (default 10): leave torchrun its shutdown
# timeout (300 s) to write the stop checkpoint.
exec docker run --rm --gpus all --ipc=host --shm-size 16g --stop-timeout 310 \
  -e TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-300}" \
  -v "${MODELS_DIR:-/models}:/models:ro" -v "${DATA_DIR:-/data}:/data:ro" -v "$PWD/runs:/app/runs" \
  "${IMAGE:-dflash_ddp}" "$@"
