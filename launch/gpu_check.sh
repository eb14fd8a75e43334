#!/usr/bin/env bash
# The evidence a first GPU run needs, in one command of at most BUDGET_S seconds (default 450, so that
# it ends within 8 minutes with room for start-up), for a machine with one GPU (for example one H200).
#   launch/gpu_check.sh                # on the GPU; everything lands in ${OUT:-gpu_check}/
#   launch/gpu_check.sh --dry-run      # the same steps on the CPU with tiny sizes (= DEVICE=cpu; tested;
#                                      # the flex steps use --attention dense: no flex backward on a CPU)
#   ONLY=split_gloo,dspark launch/gpu_check.sh   # the preflight and the steps named (a rerun of some)
#   ALLOW_OLDER_TORCH=1 launch/gpu_check.sh       # on an image whose torch is older than 2.13
# Steps, each under `timeout` and within what is left of the budget, each with its own log:
#   preflight         versions, device, free memory, a C compiler, a tiny torch.compile; stops the run
#                     with one line when something is missing (about 20 s on a GPU)
#   colocated_flex    the embedded default, --attention flex, --max_steps 40, then the one evaluation
#                     (real speculative decoding, 10 prompts x 96 tokens: tau and the losslessness check)
#   gpu_shapes        `python -m dflash_ddp.bench --gpu`: Qwen3-8B shapes with random weights (no download):
#                     the target truncated after layer 33 (1 + 5 forwards of 10 x 3072 tokens) and the
#                     5-layer drafter's step at 512 anchors x 16 (2 warm-up + 5 timed steps, flex): tokens/s,
#                     step time, MFU, peak memory against --plan's model, the split for 8 GPUs from the two
#                     rates, and a profile of one step when MFU < 55%; its JSON goes into the summary
#   plan_large        --plan of the next step: the predicted peak memory to set against the measured one
#   large             a recipe-shaped drafter on the embedded target: 5 layers, 512 anchors x block 16,
#                     sequences of 1024 tokens (conversations of 14 joined rows of the embedded data),
#                     8 sequences per batch in 8 chunks of 8192 draft positions, bf16, flex, gradient
#                     checkpointing forced on, 20 steps
#   split_gloo        the same run as colocated_flex (no evaluation) as a 1+1 split job on the one GPU:
#                     --channel_backend gloo (no NCCL, features through host memory, both ranks on the
#                     GPU); then one line comparing its losses with colocated_flex's at the same steps
#   dflash2_window    the embedded default as a DFlash2 drafter (dynamic convolutions, candidate selector)
#                     with a 64-token sliding window in layer 0 (full attention in layer 1), flex, 40 steps,
#                     then its evaluation (the selector's walk and the windowed cache in real decoding)
#   dspark            the embedded default as a DSpark drafter (Markov head, confidence head, the target's top
#                     64 sent with the features), flex, 40 steps, then its evaluation (the walk, the calibration)
#   plan_long_context --plan of the next step
#   long_context      32K-token conversations (480 joined rows each) on the embedded target: the target
#                     prefilled in pieces of 8192 sharing a KV cache, a 2048-token window in both drafter
#                     layers, anchors scaled with the length, flex, 5 steps: measured peak against the plan
#   colocated_sparse  the embedded default with --attention sparse, 40 steps, no evaluation
#   regenerate        64 prompts, 128 new tokens, batches of 16
# Where VLLM_PYTHON names the Python of a vLLM environment (README: vLLM in the loop), three more steps:
#   vllm_dflash       the colocated_flex run exported and served by vLLM (`evaluate --engine vllm`: a server
#                     with the drafter, then one without): lossless and vLLM's tau beside this project's
#   vllm_dflash2      the dflash2_window run (DFlash2, a sliding-window layer) exported and served by vLLM:
#                     its V2 runner on the GPU (the CPU build refuses it, as the dry run shows)
#   vllm_dspark       the dspark run exported and served by vLLM (`"method": "dspark"`, V2 runner)
#   vllm_regenerate   the regenerate step's prompts through a vLLM server (`regenerate --engine vllm`)
# The flex steps run with TORCH_LOGS=recompiles (the summary counts the recompiles); the compile caches
# (TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR) live in OUT/compile_cache and are removed at the end unless
# KEEP_COMPILE_CACHE=1; output is unbuffered, so a step killed at its limit keeps its log up to the kill.
# OUT/summary.txt: per step the exit code, seconds, peak memory (GPU: max_memory_allocated; CPU: resident
# set), seconds per optimizer step after the first logging window, loss, tau (the training estimate, and
# the evaluation's where it ran) and the plan's prediction. Exit status: the number of failed steps.
# The NCCL channel needs one GPU per rank (NCCL refuses two ranks on one device), so 2+ GPUs:
# `torchrun --nproc-per-node 2 -m dflash_ddp.train`; it is not part of this check (split_gloo is).
#
# Sizing. The dry run on a 2-core CPU machine shared with another test suite (load 3.5), seconds per
# step: preflight 7, colocated_flex 15, plan_large 12, large 13, colocated_sparse 13, regenerate 14; 74 in
# all, 37 s of CPU, most of it each process's start (importing dflash_ddp.train: 6-7 s of CPU); at load
# 6-7, 133 s; gpu_shapes adds one process start and about a second of work (tiny scale). On that CPU one
# recipe-shaped step (512 anchors x 16, S = 1024, 5 layers, sparse) takes 100-120 s, so the GPU sizes
# cannot be timed there. Estimated for one H200 and a cold compile cache (not
# measured): preflight 15-25 s, colocated_flex 60-150 s (the flex compile and its recompiles dominate;
# the evaluation took 46 s of CPU), plan_large 10 s, large 40-100 s, colocated_sparse 20-30 s,
# regenerate 15 s: 3-6 minutes. The DFlash2 and long-context steps, added later, took 10 and 6 + 7 s in the
# dry run (104 s in all, the test suite running beside it); on the H200 perhaps 40-100 s (DFlash2's layers
# and a second mask in the flex compile, its evaluation) and 10 + 30-80 s (5 steps of 32K tokens), so the
# budget may cut the last two steps (colocated_sparse, regenerate), which matter least. gpu_shapes, from
# its FLOP count: a target forward is 429 TFLOP (0.7 s at 60% of 989), a drafter step 718 model TFLOP
# (1.3-2.4 s at 55-30% MFU); with start-up, building the models, the flex compile (20-60 s cold) and the
# profile, 60-130 s. The limits below are set from these; the
# budget cuts the last steps first.
set -uo pipefail

usage() { sed -n '2,6p' "$0" | sed 's/^# \{0,1\}//'; }
case "${1:-}" in
  --dry-run) DEVICE=cpu ;;
  "") ;;
  -h | --help) usage; exit 0 ;;
  *) echo "gpu_check.sh: unknown option $1" >&2; usage >&2; exit 2 ;;
esac
if [ $# -gt 1 ]; then
  echo "gpu_check.sh: one option at most (got: $*); choose steps with ONLY=step1,step2" >&2; exit 2
fi
# a misspelt ONLY would run nothing but the preflight and end "0 step(s) failed": refused before anything runs
STEPS="preflight colocated_flex gpu_shapes plan_large large split_gloo dflash2_window dspark plan_long_context"
STEPS="$STEPS long_context colocated_sparse regenerate vllm_regenerate"
ONLY=${ONLY:-}
for asked in ${ONLY//,/ }; do
  if [[ " $STEPS " != *" $asked "* ]]; then
    echo "gpu_check.sh: ONLY names no step '$asked'; the steps: $STEPS" >&2; exit 2
  fi
done
DEVICE=${DEVICE:-cuda}
PYTHON=${PYTHON:-python}
OUT=$(realpath -m "${OUT:-gpu_check}")
cd "$(dirname "$0")/.." || exit 2  # the repository root: the embedded assets are read from there
ASSETS=dflash_ddp/assets
mkdir -p "$OUT"

export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export TORCHINDUCTOR_CACHE_DIR="$OUT/compile_cache/inductor" TRITON_CACHE_DIR="$OUT/compile_cache/triton"

# ------------------------------------------------------------------------------------------- sizes
if [ "$DEVICE" = cpu ]; then  # the dry run: every step, tiny
  BUDGET_S=${BUDGET_S:-600}
  STEPS=2 LOG_STEPS=1 TRAIN_ROWS=24 EVAL=(--eval_prompts 1 --eval_max_new_tokens 8)
  LARGE=(--num_draft_layers 2 --block_size 16 --num_anchors 32 --max_seq_len 256 --tokens_per_batch 512
    --drafter_chunk_tokens 256 --max_steps 1 --logging_steps 1)
  JOIN_ROWS=4 LARGE_ROWS=64 REGEN_ROWS=2 REGEN=(--max_new_tokens 8 --batch_size 2)
  COMPILE_BACKEND=eager  # inductor on the CPU would time the C++ compiler, not the check
  FLEX=dense             # flex has no backward on the CPU; dense is the reference of the same mask
  # limits in seconds: preflight, colocated_flex, plan_large (and plan_long_context), large, colocated_sparse,
  # regenerate, gpu_shapes, split_gloo, dflash2_window, long_context
  L_PRE=120 L_FLEX=180 L_PLAN=120 L_LARGE=180 L_SPARSE=180 L_REGEN=120 L_SHAPES=120 L_SPLIT=180 L_D2=180
  L_LONG=180 L_VLLM=240
  LONG=(--max_seq_len 2048 --tokens_per_batch 2048 --target_prefill_tokens 512 --sliding_window 256
    --max_steps 1 --logging_steps 1)
  LONG_JOIN_ROWS=30 LONG_ROWS=60
  SHAPES=(--scale tiny --target_steps 2 --drafter_steps 2 --profile always)
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # 2 threads on a loaded 2-core machine: 4x slower steps
else
  BUDGET_S=${BUDGET_S:-450}
  STEPS=40 LOG_STEPS=10 TRAIN_ROWS=0 EVAL=(--eval_prompts 10 --eval_max_new_tokens 96)
  LARGE=(--num_draft_layers 5 --block_size 16 --num_anchors 512 --max_seq_len 1024 --tokens_per_batch 8192
    --drafter_chunk_tokens 8192 --max_steps 20 --logging_steps 5)
  JOIN_ROWS=14 LARGE_ROWS=0 REGEN_ROWS=64 REGEN=(--max_new_tokens 128 --batch_size 16)
  COMPILE_BACKEND=inductor FLEX=flex
  # cold compile cache; a step cut by its limit is reported, and the budget cuts the last ones first
  L_PRE=60 L_FLEX=150 L_PLAN=40 L_LARGE=150 L_SPARSE=75 L_REGEN=45 L_SHAPES=150 L_SPLIT=90 L_D2=120
  L_LONG=120 L_VLLM=180
  LONG=(--max_seq_len 32768 --tokens_per_batch 32768 --target_prefill_tokens 8192 --sliding_window 2048
    --max_steps 5 --logging_steps 1)
  LONG_JOIN_ROWS=480 LONG_ROWS=2400
  SHAPES=(--scale qwen3-8b)
fi
# one tokenization per data set and settings (2.3 s for the embedded data; --num_proc would spawn
# workers that each import torch, which costs more)
COMMON=(--device "$DEVICE" --cache_dir "$OUT/data_cache" --save_steps 1000)

# ------------------------------------------------------------------------------------------- steps
START=$SECONDS
failed=0
: > "$OUT/summary.txt"
note() { echo "$*" | tee -a "$OUT/summary.txt"; }

# Reads what a step left (OUT/NAME/metrics.jsonl, eval.json, OUT/plan_NAME.log, its log) into one line.
summarize() {  # name, exit code, seconds, whether the step logged its recompiles (1/0)
  "$PYTHON" - "$OUT" "$@" <<'EOF'
import json, re, sys
from pathlib import Path

out, name, code, seconds = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
logs_recompiles = sys.argv[5] == "1"
fields = {"exit": code, "seconds": seconds}
if code == 124 or code == 137:
    fields["exit"] = f"{code}(timed-out)"
run = out / name
metrics = []
if (run / "metrics.jsonl").is_file():
    for line in (run / "metrics.jsonl").read_text().splitlines():
        try:
            metrics.append(json.loads(line))
        except ValueError:
            pass  # a line cut by the kill
if metrics:
    fields["steps"] = metrics[-1]["step"]
    fields["peak_gib"] = f"{max(m['peak_memory_gib'] for m in metrics):.2f}"
    fields["first_log_s"] = f"{metrics[0]['time']:.1f}@{metrics[0]['step']}"  # compile included
    if len(metrics) > 1:
        a, b = metrics[0], metrics[-1]
        fields["s_per_step"] = f"{(b['time'] - a['time']) / (b['step'] - a['step']):.3f}"
    fields["loss"] = f"{metrics[-1]['loss']:.3f}"
    fields["tau_train"] = f"{metrics[-1]['tau_estimate']:.2f}"
if (run / "eval.json").is_file():
    report = json.loads((run / "eval.json").read_text())
    tau = report["dflash"]["tau"] if "dflash" in report else report.get("tau")  # vLLM's report: top level
    fields["tau_eval"] = "none" if tau is None else f"{tau:.2f}"
    fields["lossless"] = report["lossless"]
plan = out / f"plan_{name}.log"
if plan.is_file():
    found = re.search(r"fits: \w+: ([0-9.]+) GiB needed", plan.read_text())
    fields["plan_gib"] = found.group(1) if found else "?"
log = out / f"{name}.log"
text = log.read_text(errors="replace") if log.is_file() else ""
shapes = run / "gpu_shapes.json"
if shapes.is_file():  # the benchmark's figures, then its whole JSON on a line of its own
    figures = json.loads(shapes.read_text())
    target, drafter, split = figures.get("target", {}), figures.get("drafter", {}), figures.get("split", {})
    pct = lambda x: "?" if x is None else f"{100 * x:.1f}%"  # noqa: E731
    if target:
        fields["target_tok_s"] = f"{target['tokens_per_s']:.0f}"
        fields["target_mfu"] = pct(target.get("mfu"))
    if drafter:
        fields["drafter_step_s"] = f"{drafter['step_s']:.3f}"
        fields["draft_pos_s"] = f"{drafter['draft_positions_per_s']:.0f}"
        fields["mfu"] = pct(drafter.get("mfu"))
        fields["peak_gib"] = f"{drafter['peak_gib']:.2f}"
        fields["plan_gib"] = f"{drafter['predicted_peak_gib']:.2f}"
    if split:
        fields["split_8"] = split["recommended"].replace(" ", "")
if logs_recompiles:  # the step ran with TORCH_LOGS=recompiles
    fields["recompiles"] = text.count("Recompiling function")
last = [line for line in text.splitlines() if line.strip()][-1:] or [""]
if code != 0 or name == "preflight":
    fields["last_line"] = repr(last[0][-200:])
print(f"{name:<18}" + " ".join(f"{k}={v}" for k, v in fields.items()))
if shapes.is_file():
    print(f"{name}.json " + json.dumps(json.loads(shapes.read_text()), separators=(",", ":")))
EOF
}

step() {  # name, limit in seconds, command...: run under timeout, keep its log, summarize, go on
  local name=$1 limit=$2
  shift 2
  if [ -n "${ONLY:-}" ] && [ "$name" != preflight ] && [[ ",$ONLY," != *",$name,"* ]]; then
    note "$(printf '%-18s' "$name")exit=not-asked(ONLY) seconds=0"
    return 0
  fi
  local left=$((BUDGET_S - (SECONDS - START)))
  [ "$limit" -le "$left" ] || limit=$left
  if [ "$limit" -lt 5 ]; then
    note "$(printf '%-18s' "$name")exit=skipped(budget) seconds=0"
    failed=$((failed + 1))
    return 1
  fi
  echo "-- $name: up to ${limit} s ($(date +%T))"
  local began=$SECONDS
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local code=$?
  local recompiles=0
  [[ " $* " == *" TORCH_LOGS=recompiles "* ]] && recompiles=1
  summarize "$name" "$code" "$((SECONDS - began))" "$recompiles" | tee -a "$OUT/summary.txt"
  if [ "$code" -ne 0 ]; then
    failed=$((failed + 1))
    tail -n 15 "$OUT/$name.log" | sed "s/^/   $name| /"
  fi
  return "$code"
}

note "gpu_check: device $DEVICE, budget ${BUDGET_S} s, commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD 2>/dev/null || echo '+changes'), $(date -u +%FT%TZ)"
if [ "$DEVICE" != cpu ] && command -v nvidia-smi > /dev/null; then nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1; fi

# 1. preflight: stop at once, with one line, when the run cannot work
step preflight "$L_PRE" env PREFLIGHT_BACKEND="$COMPILE_BACKEND" "$PYTHON" -u - "$DEVICE" <<'EOF' || {
import os, shutil, sys, time

begin = time.time()
device = sys.argv[1]


def fail(why):
    print(f"preflight FAILED: {why}")
    sys.exit(1)


try:
    import torch
except Exception as error:  # noqa: BLE001 - any import failure is the answer
    fail(f"import torch: {error}")
version = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
older = version < (2, 13)
if older and os.environ.get("ALLOW_OLDER_TORCH") != "1":
    fail(
        f"torch {torch.__version__}: this project needs torch>=2.13 (flex attention with mixed q/k/v dtypes); "
        "ALLOW_OLDER_TORCH=1 runs the check anyway on an image whose torch cannot be changed"
    )
try:
    import transformers
except Exception as error:  # noqa: BLE001
    fail(f"import transformers: {error}")
try:
    from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
except Exception as error:  # noqa: BLE001
    fail(f"flex attention is missing from torch {torch.__version__}: {error}")
compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
if not compiler:
    fail("no C compiler (cc/gcc) on PATH: Triton and torch.compile need one; install build-essential")
parts = [f"torch {torch.__version__} (CUDA {torch.version.cuda})", f"transformers {transformers.__version__}"]
if older:
    parts[0] += " OLDER than the 2.13 this project is tested with (ALLOW_OLDER_TORCH=1)"
parts.append(f"compiler {compiler}")
if device == "cuda":
    if not torch.cuda.is_available():
        fail(f"torch.cuda.is_available() is False (torch {torch.__version__}, CUDA {torch.version.cuda})")
    free, total = torch.cuda.mem_get_info()
    parts.append(f"{torch.cuda.get_device_name(0)}, {free / 2**30:.1f} of {total / 2**30:.1f} GiB free")
backend = os.environ.get("PREFLIGHT_BACKEND", "inductor")
start = time.time()
try:
    fn = torch.compile(lambda x: torch.nn.functional.silu(x) * 2 + 1, backend=backend)
    x = torch.randn(256, 256, device=device)
    ok = torch.allclose(fn(x), torch.nn.functional.silu(x) * 2 + 1, atol=1e-5)
except Exception as error:  # noqa: BLE001
    fail(f"a tiny torch.compile ({backend}) on {device}: {type(error).__name__}: {str(error)[:300]}")
if not ok:
    fail(f"a tiny torch.compile ({backend}) on {device} gave wrong values")
parts.append(f"torch.compile ({backend}) {time.time() - start:.1f} s")
print("preflight ok: " + "; ".join(parts) + f"; {time.time() - begin:.1f} s")
EOF
  note "stopped after the preflight ($(tail -n 1 "$OUT/preflight.log" 2> /dev/null)): nothing else was run"
  exit 1
}

# the data of the steps below
if [ "$TRAIN_ROWS" -gt 0 ]; then
  head -n "$TRAIN_ROWS" "$ASSETS/data/docstring_qa_regenerated.jsonl" > "$OUT/train_rows.jsonl"
  DATA=(--target_model embedded --data "$OUT/train_rows.jsonl")  # the embedded default's preset, other rows
else
  DATA=()  # the embedded default's own data
fi
# long conversations: every `join` consecutive rows of the first `limit` (0: all) joined into one (their system
# turns after the first dropped); truncated to --max_seq_len by the trainer
join_rows() {  # out file, join, limit
  "$PYTHON" - "$ASSETS/data/docstring_qa_regenerated.jsonl" "$@" <<'EOF'
import json, sys

rows = [json.loads(line)["messages"] for line in open(sys.argv[1])]
join, limit = int(sys.argv[3]), int(sys.argv[4])
rows = rows[:limit] if limit else rows
with open(sys.argv[2], "w") as f:
    for i in range(0, len(rows) - join + 1, join):
        turns = [m for j, r in enumerate(rows[i : i + join]) for m in r if j == 0 or m["role"] != "system"]
        f.write(json.dumps({"messages": turns}) + "\n")
EOF
}
join_rows "$OUT/long.jsonl" "$JOIN_ROWS" "$LARGE_ROWS"
join_rows "$OUT/long_context.jsonl" "$LONG_JOIN_ROWS" "$LONG_ROWS"
head -n "$REGEN_ROWS" "$ASSETS/data/docstring_qa.jsonl" > "$OUT/prompts.jsonl"

# 2. the embedded default on the device with flex attention, and the run's one evaluation
step colocated_flex "$L_FLEX" env TORCH_LOGS=recompiles "$PYTHON" -u -m dflash_ddp.train "${COMMON[@]}" \
  "${DATA[@]}" --attention "$FLEX" --max_steps "$STEPS" --logging_steps "$LOG_STEPS" "${EVAL[@]}" \
  --output_dir "$OUT/colocated_flex"
# 3. Qwen3-8B shapes with random weights: target forward, drafter step, MFU, memory, the split for 8 GPUs
step gpu_shapes "$L_SHAPES" env TORCH_LOGS=recompiles "$PYTHON" -u -m dflash_ddp.bench --gpu "${SHAPES[@]}" \
  --device "$DEVICE" --out "$OUT/gpu_shapes"
# 4-5. the recipe-shaped drafter: predicted peak, then measured (bf16 on CUDA, chunks, checkpointing)
LARGE+=(--target_model embedded --data "$OUT/long.jsonl" --attention "$FLEX" --gradient_checkpointing true --eval_data "")
step plan_large "$L_PLAN" "$PYTHON" -u -m dflash_ddp.train "${COMMON[@]}" "${LARGE[@]}" --plan \
  --output_dir "$OUT/large"
step large "$L_LARGE" env TORCH_LOGS=recompiles "$PYTHON" -u -m dflash_ddp.train "${COMMON[@]}" "${LARGE[@]}" \
  --output_dir "$OUT/large"
# 6. the split job's CUDA paths on one GPU (receiver stream, bf16 features, warm-up, barriers, checkpoint of
#    CUDA tensors): 1 target + 1 drafter rank sharing the GPU, the channel through host memory (NCCL refuses
#    two ranks on one GPU); the same run as step 2 without its evaluation, so the losses should follow it
step split_gloo "$L_SPLIT" env TORCH_LOGS=recompiles "$PYTHON" -u -m torch.distributed.run --standalone \
  --nproc-per-node 2 -m dflash_ddp.train "${COMMON[@]}" "${DATA[@]}" --attention "$FLEX" --channel_backend gloo \
  --max_steps "$STEPS" --logging_steps "$LOG_STEPS" --eval_data "" --output_dir "$OUT/split_gloo"
note "$("$PYTHON" - "$OUT" <<'EOF'
import json, sys
from pathlib import Path

def losses(name):
    path = Path(sys.argv[1]) / name / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return {m["step"]: m["loss"] for m in map(json.loads, lines) if "loss" in m}

colocated, split = losses("colocated_flex"), losses("split_gloo")
common = sorted(set(colocated) & set(split))
diffs = [abs(colocated[s] - split[s]) for s in common]
print(f"losses colocated vs 1+1: steps {common}, max |difference| {max(diffs) if diffs else 'n/a'}")
EOF
)"
# 7. DFlash2 on the device: its convolutions and selector under bf16 autocast, a windowed layer beside a full
#    one (two masks in one flex run), and its evaluation (the selector's walk, the windowed decoding cache)
step dflash2_window "$L_D2" env TORCH_LOGS=recompiles "$PYTHON" -u -m dflash_ddp.train "${COMMON[@]}" \
  "${DATA[@]}" --drafter dflash2 --sliding_window 64 --sliding_layers 0 --attention "$FLEX" \
  --max_steps "$STEPS" --logging_steps "$LOG_STEPS" "${EVAL[@]}" --output_dir "$OUT/dflash2_window"
# 7b. DSpark on the device: the Markov and confidence heads under bf16 autocast, the target's top-k through
#     the colocated path, and its evaluation (the left-to-right walk, the confidence calibration)
step dspark "$L_D2" env TORCH_LOGS=recompiles "$PYTHON" -u -m dflash_ddp.train "${COMMON[@]}" \
  "${DATA[@]}" --drafter dspark --target_topk 64 --attention "$FLEX" \
  --max_steps "$STEPS" --logging_steps "$LOG_STEPS" "${EVAL[@]}" --output_dir "$OUT/dspark"
# 8. long context: predicted peak, then measured (prefill pieces, windowed flex masks over 32K keys)
LONG+=(--target_model embedded --data "$OUT/long_context.jsonl" --attention "$FLEX" --eval_data "")
step plan_long_context "$L_PLAN" "$PYTHON" -u -m dflash_ddp.train "${COMMON[@]}" "${LONG[@]}" --plan \
  --output_dir "$OUT/long_context"
step long_context "$L_LONG" env TORCH_LOGS=recompiles "$PYTHON" -u -m dflash_ddp.train "${COMMON[@]}" \
  "${LONG[@]}" --output_dir "$OUT/long_context"
# 9. the block-sparse path on the same run as step 2: loss should follow the flex run's
step colocated_sparse "$L_SPARSE" "$PYTHON" -u -m dflash_ddp.train "${COMMON[@]}" "${DATA[@]}" \
  --attention sparse --max_steps "$STEPS" --logging_steps "$LOG_STEPS" --eval_data "" \
  --output_dir "$OUT/colocated_sparse"
# 10. regeneration on the device (bf16 generate on CUDA, left padding)
step regenerate "$L_REGEN" "$PYTHON" -u -m dflash_ddp.regenerate --target_model "$ASSETS/tiny_qwen3" \
  --data "$OUT/prompts.jsonl" --out "$OUT/regenerated.jsonl" --device "$DEVICE" "${REGEN[@]}"
# 11-13. vLLM serving what this project exported, and regenerating through it (VLLM_PYTHON only)
if [ -n "${VLLM_PYTHON:-}" ]; then
  serve() {  # name, run directory: export the run, then evaluate it in vLLM
    local name=$1 run=$2
    "$PYTHON" -m dflash_ddp.export "$run" "$OUT/$name.export" > "$OUT/$name.export.log" 2>&1 &&
      step "$name" "$L_VLLM" "$PYTHON" -u -m dflash_ddp.evaluate --engine vllm --vllm_python "$VLLM_PYTHON" \
        --target_model "$ASSETS/tiny_qwen3" --drafter "$OUT/$name.export" --data "$ASSETS/data/heldout_regenerated.jsonl" \
        --num_prompts "${EVAL[1]}" --max_new_tokens "${EVAL[3]}" --device "$DEVICE" --json "$OUT/$name/eval.json"
  }
  mkdir -p "$OUT/vllm_dflash" "$OUT/vllm_dflash2" "$OUT/vllm_dspark"
  serve vllm_dflash "$OUT/colocated_flex"
  serve vllm_dflash2 "$OUT/dflash2_window"  # on the CPU build: one line with vLLM's refusal, exit 2
  serve vllm_dspark "$OUT/dspark"  # likewise
  step vllm_regenerate "$L_VLLM" "$PYTHON" -u -m dflash_ddp.regenerate --engine vllm --vllm_python "$VLLM_PYTHON" \
    --target_model "$ASSETS/tiny_qwen3" --data "$OUT/prompts.jsonl" --out "$OUT/regenerated_vllm.jsonl" \
    --max_new_tokens "${REGEN[1]}"
fi

# keep logs, metrics.jsonl, data_stats.json, eval.json, the summary; drop weights and caches
note "compile cache: $(du -sh "$OUT/compile_cache" 2> /dev/null | cut -f1 || echo none)"
rm -rf "$OUT"/*/checkpoints "$OUT"/*.export "$OUT/data_cache" "$OUT"/regenerated*.jsonl.parts
[ "${KEEP_COMPILE_CACHE:-0}" = 1 ] || rm -rf "$OUT/compile_cache"
note "$failed step(s) failed; $((SECONDS - START)) s in all"
exit "$failed"
