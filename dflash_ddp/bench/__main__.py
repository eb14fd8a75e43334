"""`python -m dflash_ddp.bench [--only SECTIONS] [--steps N]`: see the package docstring.

`python -m dflash_ddp.bench --gpu [--scale tiny] [--out DIR]`: Qwen3-8B-shaped target forward and drafter
step on one GPU (gpu_shapes.py; not among the default sections: it needs a GPU, or `--scale tiny`).

`python -m dflash_ddp.bench --only long_context [--quick] [--long_out DIR]`: drafters for a tiny long-context target,
tau by context length, memory and s/step against --plan at 2K-16K tokens (long_context.py; about an hour on 2
cores, resumable).

`python -m dflash_ddp.bench --method [--quick] [--jobs 2] [--method_out DIR]`: the objective variants at equal
budget on two targets, by real tau over 3 seeds (method.py; about an hour on 2 cores, resumable).

`python -m dflash_ddp.bench --only warm_start [--quick] [--jobs 2] [--warm_out DIR]`: a drafter fine-tuned on a
second domain (`--init_from`) against training from scratch there (warm_start.py; resumable).
`python -m dflash_ddp.bench --only engine_tau,regeneration --vllm_python PATH [--drafter EXPORT]`: vLLM beside
this project: tau at temperatures 0 / 0.6 / 1.0 in both decoders, and regeneration's rows/s through
transformers and through vLLM (engines.py; minutes, vLLM's own environment needed)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from dflash_ddp.bench import __doc__ as summary
from dflash_ddp.bench.channel import bench_channel, bench_job
from dflash_ddp.bench.drafter import bench_attention_paths, bench_chunked_recipe
from dflash_ddp.bench.engines import bench_engine_tau, bench_regeneration
from dflash_ddp.bench.gpu_shapes import add_arguments as add_gpu_shapes_arguments
from dflash_ddp.bench.long_context import bench_long_context
from dflash_ddp.bench.long_plan import bench_long_plan
from dflash_ddp.bench.method import TARGETS, VARIANTS, bench_method
from dflash_ddp.bench.op_count import run_gpu_shapes as bench_gpu_shapes
from dflash_ddp.bench.speed import bench_plain_loop
from dflash_ddp.bench.step_cost import bench_step_cost
from dflash_ddp.bench.warm_start import bench_warm_start

SECTIONS = {
    "channel": lambda args: bench_channel(),
    "job": lambda args: bench_job(args.steps),
    "plain": lambda args: bench_plain_loop(args.plain_steps),
    "steps": lambda args: bench_step_cost(
        args.cost_steps, tuple(int(t) for t in args.cost_tokens.split(","))
    ),
    "attention": lambda args: bench_attention_paths(),
    "recipe": lambda args: bench_chunked_recipe(),
    "gpu_shapes": bench_gpu_shapes,
    "long_plan": lambda args: bench_long_plan(),
    "long_context": lambda args: bench_long_context(
        Path(args.long_out),
        args.quick,
        args.jobs,
        args.long_seed,
        [v.strip() for v in args.long_variants.split(";")] if args.long_variants else None,
        not args.long_variants,
    ),
    "method": lambda args: bench_method(
        Path(args.method_out),
        args.quick,
        args.jobs,
        [t.strip() for t in args.targets.split(",")],
        [v.strip() for v in args.variants.split(",")],
    ),
    "warm_start": lambda args: bench_warm_start(Path(args.warm_out), args.quick, args.jobs),
    "engine_tau": lambda args: bench_engine_tau(
        args.drafter, needs_vllm(args), args.engine_prompts, args.engine_tokens
    ),
    "regeneration": lambda args: bench_regeneration(needs_vllm(args), args.regen_rows, args.regen_tokens),
}
DEFAULT = [
    "channel",
    "job",
    "plain",
    "steps",
    "attention",
    "recipe",
    "long_plan",
]  # the CPU figures of docs/benchmarks.md


def needs_vllm(args) -> str:
    """--vllm_python, which the engine sections need."""
    if not args.vllm_python:
        raise SystemExit(
            "--only engine_tau / regeneration: pass --vllm_python PATH (vLLM's own Python; README)"
        )
    return args.vllm_python


def main() -> None:
    parser = argparse.ArgumentParser(description=summary.split("\n\n")[0])
    parser.add_argument("--only", default=",".join(DEFAULT), help=f"comma-separated of {', '.join(SECTIONS)}")
    parser.add_argument("--gpu", action="store_true", help="= --only gpu_shapes")
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps of the 3+1 job")
    parser.add_argument(
        "--plain_steps", type=int, default=200, help="steps of the trainer vs plain-loop runs"
    )
    parser.add_argument(
        "--cost_steps",
        type=int,
        default=20,
        help="timed steps of the step-cost section at 512 tokens per step (fewer at more tokens)",
    )
    parser.add_argument(
        "--cost_tokens", default="512,4096,32768", help="tokens per step of the step-cost section's rows"
    )
    long = parser.add_argument_group("--only long_context (drafters at long context, tau by context length)")
    long.add_argument("--long_out", default="runs/bench-long", help="the long target, runs and results")
    long.add_argument("--long_seed", type=int, default=0, help="the drafters' seed (the target's is fixed)")
    long.add_argument(
        "--long_variants",
        default="",
        help="drafter names separated by ; (unset: all, and the lengths' table)",
    )
    add_gpu_shapes_arguments(parser)
    method = parser.add_argument_group("--method (objective variants by real tau)")
    method.add_argument("--method", action="store_true", help="= --only method")
    method.add_argument(
        "--quick", action="store_true", help="a few steps, 2 prompts, 1 seed: minutes, for tests"
    )
    method.add_argument("--jobs", type=int, default=2, help="training runs at a time (one thread each)")
    method.add_argument(
        "--method_out", default="runs/bench-method", help="results, runs and the second target"
    )
    method.add_argument(
        "--targets", default=",".join(TARGETS), help=f"comma-separated of {', '.join(TARGETS)}"
    )
    method.add_argument(
        "--variants", default=",".join(VARIANTS), help=f"comma-separated of {', '.join(VARIANTS)}"
    )
    warm = parser.add_argument_group(
        "--only warm_start (fine-tuning a drafter on a second domain; --quick, --jobs)"
    )
    warm.add_argument("--warm_out", default="runs/bench-warm-start", help="domain B, runs and results")
    engines = parser.add_argument_group("--only engine_tau,regeneration (vLLM beside this project)")
    engines.add_argument("--vllm_python", default="", help="the Python of vLLM's own environment")
    engines.add_argument(
        "--drafter", default="runs/embedded-default-export", help="engine_tau: an exported drafter"
    )
    engines.add_argument("--engine_prompts", type=int, default=20, help="engine_tau: held-out prompts")
    engines.add_argument("--engine_tokens", type=int, default=128, help="engine_tau: new tokens per prompt")
    engines.add_argument("--regen_rows", type=int, default=64, help="regeneration: rows of the embedded data")
    engines.add_argument("--regen_tokens", type=int, default=128, help="regeneration: max_new_tokens")
    args = parser.parse_args()
    if args.gpu:
        args.only = "gpu_shapes"
    if args.method:
        args.only = "method"
    chosen = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in SECTIONS]
    if unknown:
        parser.error(f"--only {','.join(unknown)}: choose among {', '.join(SECTIONS)}")
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs")
    for name in chosen:
        try:
            SECTIONS[name](args)
        except ValueError as e:  # bad input (a flag, a device): one line, the sections before it printed
            raise SystemExit(f"error (bench {name}): {e}") from None


if __name__ == "__main__":
    main()
