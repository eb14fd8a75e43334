"""(i) `python -m dflash_ddp.bench --only long_plan`: `--plan`'s memory model for Qwen3-8B at long context, as
the recipe's 7+1 launch on 8 GPUs of 141 GB (H200), from Qwen3-8B's published shape (no download): each
rank's predicted peak and one message at 8K-128K tokens per sequence, for each drafter family (selector
codebooks shown apart), then the target rank with its prefill in pieces. A prediction, not a measurement.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path

import torch
from transformers import Qwen3Config

from dflash_ddp.config import parse_config
from dflash_ddp.drafter.config import drafter_config_for
from dflash_ddp.drafter.families import FAMILIES
from dflash_ddp.parallel.machine import GIB
from dflash_ddp.parallel.topology import Topology
from dflash_ddp.setup.plan import context_length_plans, longest_fitting
from dflash_ddp.target_model.info import target_info_from_config
from dflash_ddp.target_model.text_stack import read_text_stack

RECIPE = Path(__file__).resolve().parents[2] / "configs" / "qwen3-8b.yaml"
# Qwen/Qwen3-8B's config.json (the fields the plan reads)
QWEN3_8B = dict(
    vocab_size=151936,
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
GPU_GIB = 141
PREFILL_PIECE = 8192  # the prefill's piece in the table's last lines
WORLD = 8


def bench_long_plan() -> list[str]:
    """Print (and return) the table's lines."""
    with tempfile.TemporaryDirectory() as scratch:
        config = Qwen3Config(**QWEN3_8B)
        config.save_pretrained(scratch)
        info = target_info_from_config(config, Path(scratch), read_text_stack(Path(scratch)))  # read once
        rank = WORLD - 1  # the drafter rank of the 7+1 launch; a node holds both kinds of rank
        launch = {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": WORLD, "LOCAL_WORLD_SIZE": WORLD}
        before = {key: os.environ.get(key) for key in launch}
        os.environ.update({key: str(value) for key, value in launch.items()})
        try:
            cfg, _ = parse_config(["--config", str(RECIPE)])
            device = torch.device("cuda")  # bf16 sizes and the flex path; nothing runs on it
            topology = Topology(WORLD, rank, 1)
            plans = {}
            for family, (config_class, _) in FAMILIES.items():  # each with its defaults
                c = drafter_config_for(
                    info,
                    cfg.num_draft_layers,
                    cfg.target_layer_ids,
                    cfg.mask_token_id,
                    cfg.block_size,
                    config_class,
                )
                plans[family] = context_length_plans(cfg, info, c, topology, device, GPU_GIB * GIB)
            # the target rank alone depends on the prefill: pieces run a piece's layer tensors at a time, and
            # keep the batch's KV cache and a piece's attention mask beside them
            pieces = dataclasses.replace(cfg, target_prefill_tokens=PREFILL_PIECE)
            dflash = drafter_config_for(
                info, cfg.num_draft_layers, cfg.target_layer_ids, cfg.mask_token_id, cfg.block_size
            )
            prefilled = context_length_plans(pieces, info, dflash, topology, device, GPU_GIB * GIB)
        finally:
            for key, value in before.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
    lines = [
        f"(i) --plan for Qwen3-8B, 7+1 on {WORLD} x {GPU_GIB} GB ({RECIPE.name}, --max_seq_len = the length, "
        "--tokens_per_batch at least that)",
        "| drafter | tokens per sequence | drafter rank | target rank | message | fits |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for family, rows in plans.items():
        for p in rows:
            m = p.memory
            lines.append(
                f"| {family} | {p.length} | {m.drafter.total / GIB:.1f} GiB ({m.drafter.describe()}) | "
                f"{m.target.total / GIB:.1f} GiB ({m.target.describe()}) | {p.message_bytes / GIB:.2f} GiB | "
                f"{'yes' if m.fit.fits else 'no'} |"
            )
        positions = QWEN3_8B["max_position_embeddings"]
        within = [p for p in rows if p.length <= positions]
        lines.append(
            f"{family}: longest that fits the memory: {longest_fitting(rows)} tokens; within the target's "
            f"max_position_embeddings {positions} (what --plan's longest_context "
            f"says): {longest_fitting(within)}; the drafter's execution at {rows[0].length}: "
            f"{rows[0].memory.execution.describe()}"
        )
    lines.append(f"the target rank with --target_prefill_tokens {PREFILL_PIECE}:")
    lines += ["| tokens per sequence | target rank |", "| --- | --- |"]
    lines += [
        f"| {p.length} | {p.memory.target.total / GIB:.1f} GiB ({p.memory.target.describe()}) |"
        for p in prefilled
    ]
    print("\n".join(lines))
    return lines
