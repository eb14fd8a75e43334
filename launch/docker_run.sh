#!/usr/bin/env bash
# Run the job in the image built from the Dockerfile, on every GPU of this machine.
#   docker build -t dflash_ddp . && launch/docker_run.sh --config configs/qwen3-8b.yaml
# Hub names (the configs' Qwen/Qwen3-8B, org/dataset) resolve through the host's Hugging Face cache, mounted
# at the image's HF_HOME; HF_TOKEN and HF_HUB_OFFLINE pass through. Local model and data directories can be
# mounted at /models and /data; checkpoints land in ./runs on the host (OUT_DIR: another folder); NPROC
# passes through (the processes of the job).
set -euo pipefail
# Only ./runs is mounted: an --output_dir flag anywhere else would be written inside the container, and --rm
# deletes it with the checkpoints (a --config file's output_dir is not looked at: keep it under runs/ too).
# OUT_DIR=/shared/runs mounts another host folder there instead.
previous=""
for arg in "$@"; do
  dir=""
  case "$arg" in --output_dir=*) dir=${arg#--output_dir=} ;; esac
  [ "$previous" = "--output_dir" ] && dir=$arg
  dir=${dir#./}
  if [ -n "$dir" ] && [[ "$dir" != runs && "$dir" != runs/* && "$dir" != /app/runs && "$dir" != /app/runs/* ]]; then
    echo "docker_run.sh: --output_dir $dir is not under runs/, the one folder the container writes to the host" \
      "(OUT_DIR=HOST_FOLDER mounts that folder as runs/); pass --output_dir runs/NAME" >&2
    exit 2
  fi
  previous=$arg
done
# `docker stop` waits --stop-timeout seconds before SIGKILL (default 10): leave torchrun its shutdown
# timeout (300 s) to write the stop checkpoint.
exec docker run --rm --gpus all --ipc=host --shm-size 16g --stop-timeout 310 \
  -e TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-300}" -e HF_TOKEN -e HF_HUB_OFFLINE -e NPROC \
  -v "${HF_HOME:-$HOME/.cache/huggingface}:/root/.cache/huggingface" \
  -v "${MODELS_DIR:-/models}:/models:ro" -v "${DATA_DIR:-/data}:/data:ro" -v "${OUT_DIR:-$PWD/runs}:/app/runs" \
  "${IMAGE:-dflash_ddp}" "$@"
