"""The drafter's training step on the CPU: dense vs block-sparse attention, and chunked batches.

Every point runs in a fresh process (`python -m dflash_ddp.bench.drafter POINT_JSON`) so that its peak
resident memory is its own: the peak is measured as the resident size's high-water mark minus the
resident size just before the first step, and set against drafter/memory.py's prediction of the same parts.
Width: the embedded tiny target's (hidden 256, 4 heads, MLP 512, vocabulary 2048), one CPU thread.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import torch

from dflash_ddp.config import EMBEDDED_TARGET
from dflash_ddp.data.batch import Batch
from dflash_ddp.data.chat_template import load_target_tokenizer
from dflash_ddp.drafter.config import DFlashDraftConfig, default_target_layer_ids, drafter_config_for
from dflash_ddp.drafter.memory import DrafterLoad, drafter_memory
from dflash_ddp.drafter.trainer import DrafterTrainer, OptimizerSettings, StepSettings, build_drafter
from dflash_ddp.drafter.weighting import LOSS_PIECE_ROWS
from dflash_ddp.parallel.machine import GIB, peak_resident_bytes, process_baseline
from dflash_ddp.target_model.head import SharedTargetHead
from dflash_ddp.target_model.info import inspect_target


def _config(layers: int) -> DFlashDraftConfig:
    """A drafter of the embedded tiny target's width with `layers` layers, block 16."""
    info = inspect_target(EMBEDDED_TARGET)
    mask_id = load_target_tokenizer(info.path, "").mask_token_id
    return drafter_config_for(info, layers, default_target_layer_ids(info.num_layers), mask_id, 16)


def _batch(c: DFlashDraftConfig, sequences: int, seq_len: int, seed: int) -> tuple[Batch, torch.Tensor]:
    """Random sequences whose last 7/8 is response (the loss) and random tapped features."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, c.vocab_size, (sequences, seq_len), generator=g)
    attention = torch.ones(sequences, seq_len, dtype=torch.long)
    loss = attention.clone()
    loss[:, : seq_len // 8] = 0
    features = torch.randn(sequences, seq_len, len(c.target_layer_ids) * c.hidden_size, generator=g)
    return Batch(ids, attention, loss, torch.arange(sequences) + seed * sequences), features


def run_point(point: dict) -> dict:
    """Time `steps` training steps (after a warm-up step if `warmup`); peak memory above the resident size
    before the first step."""
    torch.set_num_threads(1)
    config = _config(point["layers"])
    drafter = build_drafter(config, 0, torch.device("cpu"))
    drafter.gradient_checkpointing = point.get("checkpointing", False)
    g = torch.Generator().manual_seed(1)
    head = SharedTargetHead(
        *(torch.randn(config.vocab_size, config.hidden_size, generator=g) * 0.02 for _ in range(2))
    )
    settings = StepSettings(point["anchors"], 0, 1.0, point["attention"], point["chunk_tokens"])
    trainer = DrafterTrainer(drafter, head, settings, OptimizerSettings(6e-4, 0.0, 0.0, 100))
    first = 0 if point["warmup"] else 1  # batch 0 is the warm-up step's
    batches = [
        _batch(config, point["sequences"], point["seq_len"], s) for s in range(first, point["steps"] + 1)
    ]
    before = process_baseline()
    if point["warmup"]:
        trainer.step([(*batches.pop(0), 0)])
    start = time.perf_counter()
    for batch, features in batches:
        trainer.step([(batch, features, 0)])
    seconds = (time.perf_counter() - start) / point["steps"]
    peak = peak_resident_bytes() - before
    anchors = min(point["anchors"], point["seq_len"] - point["seq_len"] // 8 - 1)  # response positions
    positions = min(point["chunk_tokens"], point["sequences"] * anchors * 16)
    tokens = point["sequences"] * point["seq_len"]
    load = DrafterLoad(
        num_params=0,
        optimizer_state=0,
        chunk_tokens=positions,
        tokens_per_batch=tokens,
        max_seq_len=point["seq_len"],
        loss_chunk_size=LOSS_PIECE_ROWS,  # StepSettings' default loss, in pieces
        attention=point["attention"],
        dtype_bytes=4,
        received_batches=0,
        checkpointing=drafter.gradient_checkpointing,
    )
    plan = drafter_memory(config, load)
    # weights and the head exist before `before`; gradients and AdamW moments only after the first step
    head_part = plan.parts["target embedding+LM head"]
    predicted = plan.total - head_part + sum(p.numel() for p in drafter.parameters()) * 12
    return {"s_per_step": seconds, "peak_gib": peak / GIB, "predicted_gib": predicted / GIB}


def measure(point: dict, tight: bool = False) -> dict:
    """`run_point` in a fresh process with one thread. `tight`: glibc returns every freed block of 64 KiB
    and more to the system at once (fixed mmap threshold), so the resident peak is the tensors' own peak;
    by default glibc keeps freed memory for reuse (faster: fewer page faults) and the resident peak is
    higher by what it keeps (docs/LOG.md)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if tight:
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    result = subprocess.run(
        [sys.executable, "-m", "dflash_ddp.bench.drafter", json.dumps(point)],
        capture_output=True,
        text=True,
        env=env,
    )
    if result.returncode != 0:
        raise RuntimeError(result.stderr[-2000:])
    return json.loads(result.stdout.strip().splitlines()[-1])


def bench_attention_paths(anchor_counts=(64, 256, 512), lengths=(512, 1024, 3072)) -> None:
    """Dense vs block-sparse attention: step time and peak memory of a 2-layer drafter, one sequence; the
    peak with glibc's default retention and with freed memory returned at once (the tensors' peak)."""
    print(
        "(e) drafter step, dense boolean-mask SDPA vs block-sparse attention (2 layers, 1 sequence, 1 thread)"
    )
    for seq_len in lengths:
        for anchors in anchor_counts:
            point = {
                "layers": 2,
                "anchors": anchors,
                "seq_len": seq_len,
                "sequences": 1,
                "steps": 1,
                "warmup": 1,
                "chunk_tokens": anchors * 16,
            }
            dense = measure({**point, "attention": "dense"})
            sparse = measure({**point, "attention": "sparse"})
            dense_t = measure({**point, "attention": "dense"}, tight=True)
            sparse_t = measure({**point, "attention": "sparse"}, tight=True)
            print(
                f"    S={seq_len:5d} {anchors:3d} anchors: dense {dense['s_per_step']:6.2f} s {dense['peak_gib']:5.2f} GiB"
                f" | sparse {sparse['s_per_step']:6.2f} s {sparse['peak_gib']:5.2f} GiB"
                f" ({dense['s_per_step'] / sparse['s_per_step']:4.1f}x faster,"
                f" {dense['peak_gib'] / sparse['peak_gib']:4.1f}x less memory)"
                f" | tensors' peak: dense {dense_t['peak_gib']:5.2f} GiB, sparse {sparse_t['peak_gib']:5.2f} GiB"
                f" ({dense_t['peak_gib'] / sparse_t['peak_gib']:4.1f}x less; predicted {sparse['predicted_gib']:.2f} GiB)"
            )


def bench_chunked_recipe(sequence_counts=(1, 2, 4)) -> None:
    """The recipe's shapes at reduced width: 5 layers, 512 anchors x 16, S=1024, chunks of 8192 positions;
    one cold step each (its peak includes the first allocation of gradients and AdamW moments)."""
    print(
        "(f) the paper's recipe at reduced width, chunked (5 layers, 512 anchors x 16, S=1024, chunks of 8192)"
    )
    for sequences in sequence_counts:
        point = {
            "layers": 5,
            "anchors": 512,
            "seq_len": 1024,
            "sequences": sequences,
            "steps": 1,
            "warmup": 0,
            "attention": "sparse",
            "chunk_tokens": 8192,
        }
        r, tight = measure(point), measure(point, tight=True)
        print(
            f"    {sequences:2d} sequences per batch: {r['s_per_step']:6.1f} s per step, "
            f"{r['s_per_step'] / sequences:5.1f} s per sequence, peak {r['peak_gib']:.2f} GiB "
            f"(tensors' peak {tight['peak_gib']:.2f} GiB; predicted {r['predicted_gib']:.2f} GiB)"
        )


if __name__ == "__main__":
    print(json.dumps(run_point(json.loads(sys.argv[1]))))
