"""(h) What one training step costs, by part, side by side in one run, one CPU thread, at 512, 4096 and 32768
tokens per step: the defaults (Muon and D-PACE), the same with three Polar Express steps instead of torch's
five Newton-Schulz iterations, and with those in the bf16 torch runs them in, a DFlash2 and a LiLiCorr
drafter on the defaults, D-PACE with AdamW, the paper's recipe (AdamW and the decay), and the plain loop.

The trainer's parts are timed in this process on the code the CLI runs: the target's forward
(`TargetFeatureExtractor`), the channel's work on both sides apart from the wire (packing, then unpacking
into the drafter's padded buffers; the wire itself is section (a)), the drafter's step (`DrafterTrainer.step`
with its `StepTimer` on: blocks and masks, drafter forward, loss, backward, optimizer) and logging (the
window's metrics and a metrics.jsonl line, here at every step; the CLI logs every --logging_steps). The plain
loop is `plain_loop.py` on the same sequences, in its own process.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from dflash_ddp.bench.method import LILICORR
from dflash_ddp.bench.speed import SEQ_LEN, long_conversations, plain_seconds_per_step, plain_spec
from dflash_ddp.config import EMBEDDED_TARGET, parse_config
from dflash_ddp.data.batch import padding_id
from dflash_ddp.observe.progress import TrainingMonitor
from dflash_ddp.observe.window import LoggingWindow
from dflash_ddp.parallel.channel import pack, padded_feature_buffer, unpack_tokens
from dflash_ddp.parallel.topology import Topology
from dflash_ddp.setup.run import build_schedule, load_data, prepare
from dflash_ddp.setup.target import build_extractor
from dflash_ddp.setup.trainer import build_trainer

TOKENS_PER_STEP = (512, 4096, 32768)
# name: (flags, the precision of Muon's orthogonalisation; None: the device's, fp32 on a CPU)
RECIPES = {
    "defaults": ([], None),  # Muon (torch's Newton-Schulz iterations, in fp32 on a CPU) and D-PACE
    # the plan's other execution: q/k/v and the MLP recomputed in backward, in pieces of rows
    "defaults, recompute qkv_mlp": (["--recompute", "qkv_mlp"], None),
    "defaults, three Polar Express steps": (["--muon_orthogonalisation", "polar_express_3"], None),
    "defaults, Newton-Schulz in bf16": ([], torch.bfloat16),  # torch's own precision
    "DFlash2": (["--drafter", "dflash2"], None),  # the defaults otherwise
    # the method benchmark's LiLiCorr: its correlator a quarter of the drafter's width, the target's top 64
    "LiLiCorr": ([f"--{k}={v}" for k, v in LILICORR.items()], None),
    "D-PACE, AdamW": (["--optimizer", "adamw"], None),
    "paper": (["--optimizer", "adamw", "--position_weighting", "decay", "--learning_rate", "6e-4"], None),
}
PARTS = (
    "target forward",
    "channel",
    "blocks",
    "drafter forward",
    "loss",
    "backward",
    "optimizer",
    "logging",
)


def channel_round_trip(batch, features, g: int, epoch: int) -> torch.Tensor:
    """What the channel does to a batch apart from the wire: the sender packs it, the receiver rebuilds the
    padded batch and copies each sequence's features into its buffer; returns the received features."""
    header, ints, slices = pack(batch, features, g, epoch)
    received = unpack_tokens(header, ints.clone())
    buffer = padded_feature_buffer(received, features.shape[-1], features.dtype, features.device)
    for row, piece in enumerate(slices):
        buffer[row, : piece.shape[0]].copy_(piece)
    return buffer


def load_run(flags: list[str], steps: int, out: Path):
    """(config, setup, tokenized data, schedule) of a one-process run of `flags` over `steps` steps."""
    cfg, _ = parse_config([*flags, "--output_dir", str(out), "--max_steps", str(steps)])
    topology = Topology(1, 0, 1)
    setup = prepare(cfg, topology)
    data, _ = load_data(cfg, setup, "")
    return cfg, setup, data, build_schedule(cfg, data, topology)


def trainer_parts(
    flags: list[str], ortho_dtype: torch.dtype | None, steps: int, warmup: int, out: Path
) -> dict[str, float]:
    """Seconds per step of each part, over `steps` steps after `warmup` untimed ones."""
    cfg, setup, data, schedule = load_run(flags, steps + warmup, out)
    device = torch.device("cpu")
    trainer = build_trainer(cfg, setup, device, schedule.total_steps)
    if ortho_dtype is not None:
        trainer.optimizer.ortho_dtype = ortho_dtype
    extractor = build_extractor(cfg, setup, device)
    source = SimpleNamespace(wait_s=0.0, bytes_received=0, peak_buffered_bytes=0)
    window = LoggingWindow(source, 1, device)
    monitor = TrainingMonitor(out, schedule.total_steps, quiet=True)  # the table is the output
    timer, pad_id = trainer.timer, padding_id(setup.tokenizer)
    timer.enabled = True
    totals = dict.fromkeys(PARTS, 0.0)
    tokens_seen = 0
    for step, item in enumerate(schedule.batches(0, schedule.total_steps)):
        batch = data.batch(item.members, pad_id)
        with timer.part("target forward"):
            features, soft = extractor(batch.input_ids, batch.attention_mask)
        with timer.part("channel"):  # the features' round trip; soft targets (LiLiCorr's) are handed over
            features = channel_round_trip(batch, features, item.g, item.epoch)
        result = trainer.step([(batch, features, item.epoch, soft)])
        tokens_seen += batch.num_tokens
        window.tokens += batch.num_tokens
        with timer.part("logging"):
            monitor.log(window.metrics(trainer, result, item.epoch, tokens_seen))
            window.restart()
        seconds = timer.take()
        if step >= warmup:
            for part in PARTS:
                totals[part] += seconds.get(part, 0.0) / steps
    monitor.close()
    return totals


def bench_step_cost(steps: int = 20, tokens_per_step: tuple[int, ...] = TOKENS_PER_STEP) -> None:
    """Print the step's parts of each recipe and the plain loop's step, per tokens per step; `steps` timed
    steps at 512 tokens per step, proportionally fewer (at least 2) at more."""
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="dflash-step-cost-"))
    data = work / "long.jsonl"
    base = [
        "--data", str(data), "--target_model", str(EMBEDDED_TARGET), "--num_draft_layers", "2",
        "--block_size", "16", "--num_anchors", "64", "--max_seq_len", str(SEQ_LEN), "--eval_data", "",
        "--cache_dir", str(work / "cache"), "--logging_steps", "1",
    ]  # fmt: skip
    cfg, _ = parse_config([*base, "--output_dir", str(work / "plan")])
    setup = prepare(cfg, Topology(1, 0, 1))
    long_conversations(data, setup.tokenizer)
    print(
        "(h) step cost by part, ms per step (2 drafter layers, 64 anchors x 16, sequences of 300-500 tokens, "
        f"1 thread; bf16 matmul instructions on this CPU: {cpu_has_bf16()})"
    )
    header = ["tokens/step", "recipe", "total", *PARTS, "vs paper", "vs plain"]
    print("| " + " | ".join(header) + " |")
    print("|" + " --- |" * len(header))
    for tokens in tokens_per_step:
        n = max(min(2, steps), steps * 512 // tokens)  # fewer steps where each is long (2 at least, if asked)
        warmup = 1
        flags = [*base, "--tokens_per_batch", str(tokens)]
        rows = {}
        for i, (name, (extra, ortho_dtype)) in enumerate(RECIPES.items()):
            rows[name] = trainer_parts([*flags, *extra], ortho_dtype, n, warmup, work / f"{i}-{tokens}")
        plain = plain_seconds_per_step(plain_spec(*load_run(flags, n + warmup, work / "plain"), warmup))
        paper_total = sum(rows["paper"].values())
        for name, parts in rows.items():
            total = sum(parts.values())
            cells = [f"{parts[p] * 1e3:.1f}" for p in PARTS]
            print(
                f"| {tokens} | {name} | {total * 1e3:.1f} | " + " | ".join(cells)
                + f" | {total / paper_total:.2f} | {total / plain:.2f} |"
            )  # fmt: skip
        print(f"| {tokens} | plain loop | {plain * 1e3:.1f} |" + " |" * len(PARTS) + " | 1.00 |")


def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bf16 matrices in hardware (AVX-512 BF16 or AMX), by a measured probe: a
    bf16 product at most twice the time of the fp32 one (without those instructions it is about 15x)."""

    def seconds(dtype: torch.dtype) -> float:
        x = torch.randn(256, 256).to(dtype)
        x @ x
        start = time.perf_counter()
        for _ in range(5):
            x @ x
        return time.perf_counter() - start

    return seconds(torch.bfloat16) < 2 * seconds(torch.float32)
