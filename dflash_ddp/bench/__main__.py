"""`python -m dflash_ddp.bench [--only SECTIONS] [--steps N]`: see the package docstring.

`python -m dflash_ddp.bench --gpu [--scale tiny] [--out DIR]`: Qwen3-8B-shaped target forward and drafter
step on one GPU (gpu_shapes.py; not among the default sections: it needs a GPU, or `--scale tiny`)."""

from __future__ import annotations

import argparse
import os

import torch

from . import __doc__ as summary
from .channel import bench_channel, bench_job
from .drafter import bench_attention_paths, bench_chunked_recipe
from .gpu_shapes import add_arguments as add_gpu_shapes_arguments
from .gpu_shapes import run as bench_gpu_shapes
from .speed import bench_plain_loop

SECTIONS = {
    "channel": lambda args: bench_channel(),
    "job": lambda args: bench_job(args.steps),
    "plain": lambda args: bench_plain_loop(args.plain_steps),
    "attention": lambda args: bench_attention_paths(),
    "recipe": lambda args: bench_chunked_recipe(),
    "gpu_shapes": bench_gpu_shapes,
}
DEFAULT = ["channel", "job", "plain", "attention", "recipe"]  # the CPU figures of docs/benchmarks.md


def main() -> None:
    parser = argparse.ArgumentParser(description=summary.split("\n\n")[0])
    parser.add_argument("--only", default=",".join(DEFAULT), help=f"comma-separated of {', '.join(SECTIONS)}")
    parser.add_argument("--gpu", action="store_true", help="= --only gpu_shapes")
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps of the 3+1 job")
    parser.add_argument(
        "--plain_steps", type=int, default=200, help="steps of the trainer vs plain-loop runs"
    )
    add_gpu_shapes_arguments(parser)
    args = parser.parse_args()
    if args.gpu:
        args.only = "gpu_shapes"
    chosen = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in SECTIONS]
    if unknown:
        parser.error(f"--only {','.join(unknown)}: choose among {', '.join(SECTIONS)}")
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs")
    for name in chosen:
        SECTIONS[name](args)


if __name__ == "__main__":
    main()
