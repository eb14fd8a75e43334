"""`python -m dflash_ddp.evaluate`'s command line: its flags, and the checks that refuse a flag that cannot
work before the target or the drafter loads."""

from __future__ import annotations

import argparse
from pathlib import Path

from dflash_ddp.data.chat_template import json_object
from dflash_ddp.hub import named_target


def positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def parse_arguments(argv: list[str]) -> argparse.Namespace:
    """The one-off evaluation's flags (argparse exits 2 on a malformed one)."""
    parser = argparse.ArgumentParser(
        prog="python -m dflash_ddp.evaluate",
        description="Real speculative decoding with a drafter of any family: acceptance length, speed, and the "
        "lossless check.",
    )
    parser.add_argument(
        "--target_model",
        required=True,
        type=named_target,
        help="the target's directory, hub name, or embedded (the tiny target shipped in the package)",
    )
    parser.add_argument(
        "--drafter", required=True, help="an export, a checkpoint, or a run directory (its latest checkpoint)"
    )
    parser.add_argument("--data", required=True, help="conversations (jsonl, json, parquet or a hub dataset)")
    parser.add_argument(
        "--num_prompts", type=positive_int, default=50, help="the first rows' prompts (default 50)"
    )
    parser.add_argument(
        "--max_new_tokens", type=positive_int, default=128, help="tokens decoded per prompt (default 128)"
    )
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda")
    parser.add_argument("--chat_template", default="", help="jinja file replacing the tokenizer's template")
    parser.add_argument(
        "--chat_template_kwargs", type=json_object, default={}, help="e.g. '{\"enable_thinking\": false}'"
    )
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="0: greedy, token-for-token check; > 0: sampling"
    )
    parser.add_argument("--top_p", type=float, default=1.0, help="sampling: the nucleus kept (0, 1]")
    parser.add_argument("--seed", type=int, default=0, help="sampling: prompt i draws with seed + i")
    parser.add_argument(
        "--confidence_threshold",
        type=float,
        default=0.0,
        help="a drafter with a confidence head (DSpark): verify its drafts up to the first position predicted "
        "below this acceptance (0: all)",
    )
    parser.add_argument(
        "--engine", choices=("project", "vllm"), default="project", help="who decodes: this project or vLLM"
    )
    parser.add_argument("--vllm_python", help="--engine vllm: the Python of vLLM's own environment")
    parser.add_argument(
        "--vllm_args",
        default="",
        help="--engine vllm: the servers' own flags, e.g. '--tensor-parallel-size 8'",
    )
    parser.add_argument(
        "--draft_sampling",
        choices=("greedy", "probabilistic"),
        default="greedy",
        help="--engine vllm at a temperature: vLLM drafts the argmax (greedy, its default) or samples the "
        "drafter's distribution as this project's decoder does (probabilistic)",
    )
    parser.add_argument(
        "--engine_url",
        nargs="+",
        help="--engine vllm: servers already running, the one with the drafter first (a second without it)",
    )
    parser.add_argument("--json", help="also write the report to this JSON file")
    return parser.parse_args(argv)


def argument_error(args: argparse.Namespace) -> str | None:
    """The first flag that cannot work, in one line, found before anything loads (not after it), or None."""
    json_dir = next((p for p in Path(args.json or ".").resolve().parents if p.exists()), None)
    if not 0 <= args.confidence_threshold <= 1:
        return f"--confidence_threshold {args.confidence_threshold} must be in [0, 1]"
    if args.temperature < 0:
        return f"--temperature {args.temperature} must be >= 0 (0: greedy)"
    if not 0 < args.top_p <= 1:
        return f"--top_p {args.top_p} must be in (0, 1]"
    if not args.temperature and (args.top_p != 1 or args.seed):
        return "--top_p and --seed only apply when sampling: also pass --temperature > 0"
    if args.max_new_tokens < 2:  # the first new token is the target's alone: no draft is verified before it
        return "--max_new_tokens 1: at least 2 (a verify step follows the first token)"
    if args.json and Path(args.json).is_dir():
        return f"--json {args.json}: a directory; name the report's file"
    if args.json and not json_dir.is_dir():
        return f"--json {args.json}: {json_dir} is a file, not a directory"
    if not Path(args.drafter).exists():
        return f"--drafter {args.drafter}: no such export, checkpoint or run directory"
    if args.vllm_python and not Path(args.vllm_python).is_file():
        return f"--vllm_python {args.vllm_python}: no such file (the python of vLLM's own environment)"
    return None
