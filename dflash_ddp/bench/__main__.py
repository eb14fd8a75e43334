"""`python -m dflash_ddp.bench [--only SECTIONS] [--steps N]`: see the package docstring."""

from __future__ import annotations

import argparse
import os

import torch

from . import __doc__ as summary
from .channel import bench_channel, bench_job
from .drafter import bench_attention_paths, bench_chunked_recipe
from .speed import bench_plain_loop

SECTIONS = {
    "channel": lambda args: bench_channel(),
    "job": lambda args: bench_job(args.steps),
    "plain": lambda args: bench_plain_loop(args.plain_steps),
    "attention": lambda args: bench_attention_paths(),
    "recipe": lambda args: bench_chunked_recipe(),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=summary.split("\n\n")[0])
    parser.add_argument(
        "--only", default=",".join(SECTIONS), help=f"comma-separated of {', '.join(SECTIONS)}"
    )
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps of the 3+1 job")
    parser.add_argument(
        "--plain_steps", type=int, default=200, help="steps of the trainer vs plain-loop runs"
    )
    args = parser.parse_args()
    chosen = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in SECTIONS]
    if unknown:
        parser.error(f"--only {','.join(unknown)}: choose among {', '.join(SECTIONS)}")
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs")
    for name in chosen:
        SECTIONS[name](args)


if __name__ == "__main__":
    main()
