#!/usr/bin/env bash
# One machine, one process per GPU (or NPROC CPU processes): torchrun starts them all.
#   launch/single_node.sh --config configs/qwen3-8b.yaml            # 8 GPUs as 7+1
#   NPROC=8 launch/single_node.sh --config configs/qwen3-8b.yaml --drafter_ranks 2   # 6+2
set -euo pipefail
if [ -z "${NPROC:-}" ]; then
  NPROC=$(python -c "import torch; print(torch.cuda.device_count() or 8)")
fi
exec torchrun --standalone --nproc-per-node "$NPROC" -m dflash_ddp.train "$@"
