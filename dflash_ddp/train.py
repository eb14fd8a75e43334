"""Entry point: `python -m dflash_ddp.train [--config FILE.yaml] [--key value ...]`.

With no arguments it trains a drafter for the tiny target shipped in the package and ends by measuring
tau with real speculative decoding on held-out conversations.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer

from .checkpoint import existing_checkpoints, rng_state, save_checkpoint
from .config import TrainConfig, config_to_dict, parse_config
from .data import DataStats, Sample, collate, data_fingerprint, epoch_batches, tokenize_dataset
from .model import DFlashDraftConfig, DFlashDraftModel
from .objective import peak_logits_bytes
from .progress import TrainingMonitor
from .target import SharedTargetHead, TargetFeatureExtractor, TargetInfo, inspect_target
from .trainer import (
    DrafterTrainer,
    StepSettings,
    build_drafter,
    drafter_config_for,
    resolve_mask_token_id,
    resolve_target_layer_ids,
)


@dataclass
class RunSetup:
    """Everything derived from the config before any weights load."""

    info: TargetInfo
    tokenizer: object
    drafter_config: DFlashDraftConfig
    device: torch.device


def pick_device(requested: str) -> torch.device:
    if requested == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(requested)


def prepare(cfg: TrainConfig) -> RunSetup:
    """Read the target's config and tokenizer and size the drafter; no weights are loaded."""
    info = inspect_target(cfg.target_model)
    tokenizer = AutoTokenizer.from_pretrained(info.path, local_files_only=True)
    taps = resolve_target_layer_ids(info, cfg.target_layer_ids)
    mask_id = resolve_mask_token_id(tokenizer, info, cfg.mask_token_id)
    drafter_config = drafter_config_for(info, cfg.num_draft_layers, taps, mask_id, cfg.block_size)
    return RunSetup(info, tokenizer, drafter_config, pick_device(cfg.device))


def fingerprint_files(paths: list[Path]) -> str:
    """sha256 over the names and bytes of small identity files (config, tokenizer)."""
    h = hashlib.sha256()
    for p in sorted(paths):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def drafter_parameter_count(config: DFlashDraftConfig) -> int:
    with torch.device("meta"):  # shapes only, no memory
        return sum(p.numel() for p in DFlashDraftModel(config).parameters())


def print_plan(cfg: TrainConfig, setup: RunSetup) -> None:
    """Topology, sizes and memory estimates; loads no weights."""
    c = setup.drafter_config
    params = drafter_parameter_count(c)
    rows = cfg.num_anchors * (c.block_size - 1)
    full, chunked = peak_logits_bytes(rows, c.vocab_size, cfg.loss_chunk_size)
    gib = 1 << 30
    plan = {
        "topology": "colocated: one process runs the target and trains the drafter",
        "device": str(setup.device),
        "target": f"{setup.info.path} ({setup.info.model_type}, {setup.info.num_layers} layers, hidden {setup.info.hidden_size})",
        "target_layers_run": f"0..{max(c.target_layer_ids)} of {setup.info.num_layers} (later layers, norm and LM head skipped)",
        "target_layer_ids": c.target_layer_ids,
        "mask_token_id": c.mask_token_id,
        "block_size": c.block_size,
        "drafter": f"{c.num_hidden_layers} layers, {params / 1e6:.1f}M trainable parameters",
        "drafter_memory": f"{params * 16 / gib:.2f} GiB (fp32 weights + grads + AdamW moments)",
        "logits_peak_per_sequence": f"{full / gib:.2f} GiB unchunked -> {chunked / gib:.2f} GiB with --loss_chunk_size {cfg.loss_chunk_size}",
    }
    for key, value in plan.items():
        print(f"{key:>26}: {value}")


def batch_stream(samples: list[Sample], cfg: TrainConfig, pad_id: int, total_steps: int):
    """(epoch, batch index in epoch, Batch) for the run, epoch after epoch, until total_steps."""
    lengths = [len(s.input_ids) for s in samples]
    step, epoch = 0, 0
    while step < total_steps:
        for index, members in enumerate(epoch_batches(lengths, cfg.tokens_per_batch, cfg.seed, epoch)):
            if step >= total_steps:
                return
            yield epoch, index, collate([samples[i] for i in members], pad_id)
            step += 1
        epoch += 1


def count_total_steps(samples: list[Sample], cfg: TrainConfig) -> int:
    if cfg.max_steps > 0:
        return cfg.max_steps
    lengths = [len(s.input_ids) for s in samples]
    return sum(len(epoch_batches(lengths, cfg.tokens_per_batch, cfg.seed, e)) for e in range(cfg.num_epochs))


def refuse_existing_run(output_dir: str) -> None:
    found = existing_checkpoints(output_dir)
    if found:
        raise ValueError(
            f"--output_dir {output_dir} already holds checkpoints (newest: {found[-1].name}). Resuming is not "
            "implemented yet, and starting over would silently throw that work away: pass a new --output_dir, "
            "or delete the old one if it is no longer wanted"
        )


def run_colocated(cfg: TrainConfig, setup: RunSetup) -> dict:
    """World size 1: target forward and drafter step in the same process. Returns the final metrics."""
    refuse_existing_run(cfg.output_dir)
    torch.manual_seed(cfg.seed)
    device = setup.device
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    samples, stats = tokenize_dataset(setup.tokenizer, cfg.data, cfg.max_seq_len, cfg.block_size)
    (out / "data_stats.json").write_text(json.dumps(asdict(stats), indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(config_to_dict(cfg), indent=2) + "\n")
    report_data(stats)
    total_steps = count_total_steps(samples, cfg)

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target = TargetFeatureExtractor(setup.info, setup.drafter_config.target_layer_ids, device, dtype)
    head = SharedTargetHead.from_target(setup.info).to(device=device, dtype=dtype)
    drafter = build_drafter(setup.drafter_config, cfg.seed, device)
    attention = cfg.attention if cfg.attention != "auto" else ("flex" if device.type == "cuda" else "sdpa")
    settings = StepSettings(
        cfg.num_anchors, cfg.seed, cfg.max_grad_norm, cfg.loss_chunk_size, attention, cfg.loss_gamma
    )
    trainer = DrafterTrainer(
        drafter, head, settings, cfg.learning_rate, cfg.weight_decay, total_steps, cfg.warmup_ratio
    )
    fingerprints = {
        "target": fingerprint_files([setup.info.path / "config.json"]),
        "tokenizer": fingerprint_files(sorted(setup.info.path.glob("tokenizer*"))),
        "data": data_fingerprint(samples),
    }
    pad_id = setup.tokenizer.pad_token_id if setup.tokenizer.pad_token_id is not None else 0

    monitor = TrainingMonitor(out, total_steps)
    tokens_seen, window_tokens, window_wait, window_start = 0, 0, 0.0, time.perf_counter()
    metrics: dict = {}
    try:
        for epoch, index, batch in batch_stream(samples, cfg, pad_id, total_steps):
            t0 = time.perf_counter()
            features = target(batch.input_ids.to(device), batch.attention_mask.to(device))
            window_wait += time.perf_counter() - t0
            metrics = trainer.step([(batch, features)], epoch)
            tokens_seen += batch.num_tokens
            window_tokens += batch.num_tokens
            step = trainer.global_step
            if step % cfg.logging_steps == 0 or step == total_steps:
                elapsed = time.perf_counter() - window_start
                metrics.update(
                    epoch=epoch,
                    tokens_seen=tokens_seen,
                    tokens_per_s=window_tokens / elapsed,
                    wait_fraction=window_wait / elapsed,
                )
                monitor.log(metrics)
                window_tokens, window_wait, window_start = 0, 0.0, time.perf_counter()
            if step % cfg.save_steps == 0 or step == total_steps:
                trainer_state = {
                    "global_step": step,
                    "epoch": epoch,
                    "batches_consumed": index + 1,
                    "tokens_seen": tokens_seen,
                    "topology": {"world_size": 1, "target_ranks": 0, "drafter_ranks": 1, "colocated": True},
                    "config": config_to_dict(cfg),
                    "fingerprints": fingerprints,
                }
                path = save_checkpoint(
                    out,
                    step,
                    drafter,
                    trainer.optimizer,
                    trainer.scheduler,
                    trainer_state,
                    {0: rng_state()},
                    cfg.save_total_limit,
                )
                monitor.print(f"saved {path}")
    finally:
        monitor.close()
    return metrics


def report_data(stats: DataStats) -> None:
    print(
        f"data: {stats.rows} conversations, {stats.kept} kept, {stats.truncated} truncated to --max_seq_len, "
        f"{stats.too_short} dropped (fewer than 2*block_size response tokens)"
    )


def run_final_evaluation(cfg: TrainConfig, setup: RunSetup) -> None:
    """Measure tau with real speculative decoding on held-out conversations, against baselines."""
    from .evaluate import evaluate, print_report

    latest = Path(cfg.output_dir) / "checkpoints" / "latest"
    checkpoint = latest.parent / latest.read_text().strip()
    report = evaluate(
        target_dir=cfg.target_model,
        drafter=checkpoint,
        data_path=cfg.eval_data,
        num_prompts=cfg.eval_prompts,
        max_new_tokens=cfg.eval_max_new_tokens,
        device=str(setup.device),
    )
    print_report(report)
    (Path(cfg.output_dir) / "eval.json").write_text(json.dumps(report, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        cfg, embedded = parse_config(argv)
        if embedded:
            print(f"no --target_model given: training the embedded default (tiny target {cfg.target_model})")
        setup = prepare(cfg)
        if cfg.plan:
            print_plan(cfg, setup)
            return 0
        start = time.perf_counter()
        run_colocated(cfg, setup)
        print(
            f"training took {time.perf_counter() - start:.0f} s; checkpoints in {cfg.output_dir}/checkpoints"
        )
        if cfg.eval_data:
            run_final_evaluation(cfg, setup)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
