#!/usr/bin/env bash
# One pass over the CUDA paths that CPU CI cannot reach, for a machine with one GPU (for example one
# H200). A split job needs one GPU per rank (NCCL refuses two ranks on one device), so
# the NCCL channel needs a machine with 2+ GPUs: torchrun --nproc-per-node 2 -m dflash_ddp.train. Everything lands in ${OUT:-gpu_check}/ (logs + eval/metrics JSON); keep that
# folder in docs/ when it ran. A few minutes on an H200.
#   launch/gpu_check.sh
set -uo pipefail
OUT=${OUT:-gpu_check}
mkdir -p "$OUT"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
python -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))" \
  > "$OUT/torch.txt" 2>&1

failed=0
step() {  # name, command...: run, keep the log and the exit code, go on with the next step
  local name=$1; shift
  local start=$SECONDS
  "$@" > "$OUT/$name.log" 2>&1
  local code=$?
  echo "$name: exit $code in $((SECONDS - start)) s" | tee -a "$OUT/summary.txt"
  [ "$code" -eq 0 ] || failed=$((failed + 1))
}

# 1. the embedded default, colocated on the GPU: bf16 target, flex attention, real speculative decoding
step colocated_flex python -m dflash_ddp.train --device cuda --attention flex --output_dir "$OUT/colocated_flex"
# 2. the same with the block-sparse path: the two attention paths should reach similar loss and tau
step colocated_sparse python -m dflash_ddp.train --device cuda --attention sparse --output_dir "$OUT/colocated_sparse"
# 3. regeneration on the GPU (bf16 generate, left padding), 64 rows
head -n 64 dflash_ddp/assets/data/docstring_qa.jsonl > "$OUT/prompts.jsonl"
step regenerate python -m dflash_ddp.regenerate --target_model dflash_ddp/assets/tiny_qwen3 \
  --data "$OUT/prompts.jsonl" --out "$OUT/regenerated.jsonl" --max_new_tokens 128 --batch_size 16
rm -rf "$OUT"/*/checkpoints "$OUT"/*/cache  # keep logs, metrics.jsonl, data_stats.json, eval.json
echo "$failed step(s) failed" | tee -a "$OUT/summary.txt"
exit "$failed"
