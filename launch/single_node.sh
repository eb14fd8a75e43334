#!/usr/bin/env bash
# One machine, one process per GPU (without GPUs: NPROC CPU processes, 2 unless set): torchrun starts them all.
#   launch/single_node.sh --config configs/qwen3-8b.yaml            # 8 GPUs as 7+1
#   NPROC=8 launch/single_node.sh --config configs/qwen3-8b.yaml --drafter_ranks 2   # 6+2
set -euo pipefail
if [ -z "${NPROC:-}" ]; then
  NPROC=$(python -c "import torch; print(torch.cuda.device_count() or 2)")
fi
# On SIGTERM torchrun gives the workers this long to finish their step and write the stop checkpoint
# before SIGKILL (default 30 s; a large drafter's checkpoint can take longer). Older torchruns ignore it.
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-300}"
exec torchrun --standalone --nproc-per-node "$NPROC" -m dflash_ddp.train "$@"
