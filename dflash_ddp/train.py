"""Entry point: `torchrun --nproc-per-node N -m dflash_ddp.train [--config FILE.yaml] [--key value ...]`.

Also `python -m dflash_ddp.train` (one colocated process) and `accelerate launch -m dflash_ddp.train`.
With no arguments it trains a drafter for the tiny target shipped in the package and ends by measuring
tau with real speculative decoding on held-out conversations.

A rank's role picks its loop here, once: `run_target` (compute features, send them), `run_drafter`
(receive, train, save) or `run_colocated` (both in one process). The drafter's loop is the same
function in both training roles; only where its batches come from differs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoTokenizer

from .chat_template import ChatTokenizer, load_chat_template
from .checkpoint import CheckpointWriter, SaveError, checkpoint_name, rng_state, set_aside_later
from .config import TrainConfig, config_to_dict, parse_config, usage
from .data import DataStats
from .dataset import TokenizedDataset, TokenizeSettings, load_or_tokenize
from .export import to_zlab_config
from .model import DFlashDraftConfig, DFlashDraftModel
from .objective import peak_logits_bytes
from .progress import TrainingMonitor
from .resume import check_same_run, find_checkpoint, load_tensor_file, load_trainer_state, load_weights
from .schedule import BatchSchedule, ScheduledBatch
from .signals import GracefulStop
from .target import SharedTargetHead, TargetFeatureExtractor, TargetInfo, inspect_target, target_fingerprint
from .topology import DistributedContext, Topology, env_world, init_distributed, shutdown
from .trainer import (
    DrafterTrainer,
    OptimizerSettings,
    StepSettings,
    build_drafter,
    drafter_config_for,
    resolve_mask_token_id,
    resolve_target_layer_ids,
)
from .transport import ChannelError, ChannelReceiver, ChannelSender, Message, StopFlag


@dataclass
class RunSetup:
    """Everything derived from the config before any weights load."""

    info: TargetInfo
    tokenizer: object
    drafter_config: DFlashDraftConfig


def prepare(cfg: TrainConfig) -> RunSetup:
    """Read the target's config and tokenizer and size the drafter; no weights are loaded."""
    info = inspect_target(cfg.target_model)
    tokenizer = AutoTokenizer.from_pretrained(info.path, local_files_only=True)
    load_chat_template(tokenizer, cfg.chat_template)
    taps = resolve_target_layer_ids(info, cfg.target_layer_ids)
    mask_id = resolve_mask_token_id(tokenizer, info, cfg.mask_token_id)
    drafter_config = drafter_config_for(info, cfg.num_draft_layers, taps, mask_id, cfg.block_size)
    return RunSetup(info, tokenizer, drafter_config)


def load_data(cfg: TrainConfig, setup: RunSetup, where: str) -> tuple[TokenizedDataset, DataStats]:
    """The tokenized --data, from the cache when files, tokenizer, template and settings are unchanged."""
    chat = ChatTokenizer(setup.tokenizer, cfg.chat_template_kwargs, cfg.train_last_turn_only)
    settings = TokenizeSettings(
        max_seq_len=cfg.max_seq_len,
        block_size=cfg.block_size,
        overlength=cfg.overlength,
        skip_bad_rows=cfg.skip_bad_rows,
    )
    cache_dir = Path(cfg.cache_dir or Path(cfg.output_dir) / "cache")
    data, stats, _ = load_or_tokenize(
        chat, setup.info.path, cfg.data, settings, cache_dir, cfg.num_proc, log=lambda m: print(m + where)
    )
    return data, stats


def compute_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32  # fp32 on CPU: exact parity tests


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


def print_plan(cfg: TrainConfig, setup: RunSetup, topology: Topology) -> None:
    """Topology, sizes and memory estimates; loads no weights."""
    c, info = setup.drafter_config, setup.info
    params = drafter_parameter_count(c)
    rows = cfg.num_anchors * (c.block_size - 1)
    full, chunked = peak_logits_bytes(rows, c.vocab_size, cfg.loss_chunk_size)
    gib = 1 << 30
    bf16 = 2 if torch.cuda.is_available() else 4
    # The target's layers have the drafter's width: (params - fc) / drafter layers per target layer.
    per_layer = (params - len(c.target_layer_ids) * info.hidden_size**2) // c.num_hidden_layers
    target_params = info.vocab_size * info.hidden_size + (max(c.target_layer_ids) + 1) * per_layer
    feature_bytes = cfg.tokens_per_batch * len(c.target_layer_ids) * info.hidden_size * bf16
    for line in topology.describe():
        print(f"{'topology':>26}: {line}")
    plan = {
        "target": f"{info.path} ({info.model_type}, {info.num_layers} layers, hidden {info.hidden_size})",
        "target_layers_run": f"0..{max(c.target_layer_ids)} of {info.num_layers} (later layers, norm and LM head skipped)",
        "target_layer_ids": c.target_layer_ids,
        "mask_token_id": c.mask_token_id,
        "block_size": c.block_size,
        "drafter": f"{c.num_hidden_layers} layers, {params / 1e6:.1f}M trainable parameters",
        "message_size": f"up to {feature_bytes / 2**20:.1f} MiB of features per batch (--tokens_per_batch {cfg.tokens_per_batch})",
        "target_rank_memory": f"~{target_params * bf16 / gib:.2f} GiB of weights (layers 0..{max(c.target_layer_ids)})",
        "drafter_rank_memory": f"{params * 16 / gib:.2f} GiB (fp32 weights + grads + AdamW moments) "
        f"+ {2 * info.vocab_size * info.hidden_size * bf16 / gib:.2f} GiB shared embedding/LM head",
        "logits_peak_per_sequence": f"{full / gib:.2f} GiB unchunked -> {chunked / gib:.2f} GiB with --loss_chunk_size {cfg.loss_chunk_size}",
    }
    for key, value in plan.items():
        print(f"{key:>26}: {value}")


def build_schedule(cfg: TrainConfig, data: TokenizedDataset, topology: Topology) -> BatchSchedule:
    lengths = data.lengths
    per_step = topology.num_drafters * cfg.gradient_accumulation_steps
    if cfg.max_steps > 0:
        return BatchSchedule(lengths, cfg.tokens_per_batch, cfg.seed, per_step, cfg.max_steps)
    return BatchSchedule.for_epochs(lengths, cfg.tokens_per_batch, cfg.seed, per_step, cfg.num_epochs)


@dataclass
class Run:
    """What every role loop reads: settings, data, the batch sequence and where training starts."""

    cfg: TrainConfig
    setup: RunSetup
    data: TokenizedDataset
    schedule: BatchSchedule
    identity: dict  # fingerprints, drafter config and settings: stored in, and checked against, checkpoints
    start_step: int = 0
    first_batch: int = 0  # the checkpoint's data cursor: global batches already consumed
    resume_from: Path | None = None

    @property
    def end_batch(self) -> int:
        """One past the last global batch this run consumes: the remaining steps' worth after the cursor."""
        return (
            self.first_batch + (self.schedule.total_steps - self.start_step) * self.schedule.batches_per_step
        )

    def set_accumulation(self, steps: int, topology: Topology) -> None:
        """Change gradient accumulation (to keep a resumed run's global batch); schedule and identity follow."""
        self.cfg = dataclasses.replace(self.cfg, gradient_accumulation_steps=steps)
        self.schedule = build_schedule(self.cfg, self.data, topology)
        self.identity = run_identity(self.cfg, self.setup, self.data, topology)


def run_identity(cfg: TrainConfig, setup: RunSetup, data: TokenizedDataset, topology: Topology) -> dict:
    """The parts of trainer_state.json that decide whether a checkpoint belongs to this run."""
    config = config_to_dict(cfg) | {"global_batch": topology.num_drafters * cfg.gradient_accumulation_steps}
    return {
        "config": config,
        "fingerprints": {
            "target": target_fingerprint(setup.info.path),
            "tokenizer": fingerprint_files(sorted(setup.info.path.glob("tokenizer*"))),
            "data": data.fingerprint(),
        },
        "drafter": to_zlab_config(setup.drafter_config),
    }


# --------------------------------------------------------------------------------------------- roles


def run_target(ctx: DistributedContext, run: Run) -> bool:
    """A target rank: compute the tapped features of the batches g = rank mod T, send each to its drafter.

    The drafter leader decides when the job stops: a first signal here is only noted, and the loop
    ends early when the leader raises the stop flag."""
    topo = ctx.topology
    GracefulStop().install()
    stop = StopFlag()
    extractor = TargetFeatureExtractor(
        run.setup.info, run.setup.drafter_config.target_layer_ids, ctx.device, compute_dtype(ctx.device)
    )
    sender = ChannelSender(topo.rank, run.cfg.max_inflight, ctx.device)
    pad_id = run.setup.tokenizer.pad_token_id or 0
    for item in run.schedule.batches(run.first_batch, run.end_batch):
        if topo.target_of(item.g) != topo.rank:
            continue
        if stop.is_set():
            break
        batch = run.data.batch(item.members, pad_id)
        features = extractor(batch.input_ids.to(ctx.device), batch.attention_mask.to(ctx.device))
        sender.send(topo.drafter_of(item.g), batch, features, item.g, item.epoch)
    sender.close(topo.drafter_ranks)
    return False


class LocalTarget:
    """The colocated batch source: the target runs in this process; its compute time is the 'wait'."""

    def __init__(self, extractor: TargetFeatureExtractor, run: Run):
        self.extractor, self.data = extractor, run.data
        self.pad_id = run.setup.tokenizer.pad_token_id or 0
        self.items = run.schedule.batches(run.first_batch, run.end_batch)
        self.wait_s = 0.0
        self.bytes_received = 0

    def get(self) -> Message:
        start = time.perf_counter()
        item = next(self.items)
        batch = self.data.batch(item.members, self.pad_id)
        device = self.extractor.device
        features = self.extractor(batch.input_ids.to(device), batch.attention_mask.to(device))
        self.wait_s += time.perf_counter() - start
        return Message(item.g, item.epoch, batch, features, 0, 0.0, 0)

    def drain(self) -> None:
        pass

    def close(self) -> None:
        pass


def run_colocated(ctx: DistributedContext, run: Run) -> bool:
    extractor = TargetFeatureExtractor(
        run.setup.info, run.setup.drafter_config.target_layer_ids, ctx.device, compute_dtype(ctx.device)
    )
    return train_drafter(ctx, run, LocalTarget(extractor, run))


def run_drafter(ctx: DistributedContext, run: Run) -> bool:
    topo = ctx.topology
    mine = [
        (g, topo.target_of(g))
        for g in range(run.first_batch, run.end_batch)
        if topo.drafter_of(g) == topo.rank
    ]
    source = ChannelReceiver(topo.rank, mine, topo.target_ranks, ctx.device, compute_dtype(ctx.device))
    return train_drafter(ctx, run, source)


def restore(run: Run, trainer: DrafterTrainer, rank: int) -> int:
    """Load weights, optimizer, scheduler and RNG from the resume checkpoint; returns tokens seen."""
    path = run.resume_from
    load_weights(path, trainer.drafter)
    trainer.optimizer.load_state_dict(load_tensor_file(path / "optimizer.pt"))
    trainer.scheduler.load_state_dict(load_tensor_file(path / "scheduler.pt"))
    # The loaded states carry the checkpoint's lr and weight decay; this run's settings win (they differ
    # only when the user accepted the change with --resume_override).
    cfg, scheduler = run.cfg, trainer.scheduler
    scheduler.base_lrs = [cfg.learning_rate for _ in scheduler.base_lrs]
    for group, schedule_fn in zip(trainer.optimizer.param_groups, scheduler.lr_lambdas, strict=True):
        group.update(initial_lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
        group["lr"] = cfg.learning_rate * schedule_fn(scheduler.last_epoch)
    rng_file = path / f"rng-rank{rank}.pt"
    if rng_file.is_file():
        torch.set_rng_state(load_tensor_file(rng_file)["torch"])
    trainer.global_step = run.start_step
    return int(load_trainer_state(path)["tokens_seen"])


def check_batch(message: Message, item: ScheduledBatch, rank: int) -> Message:
    """Lockstep safety: the batch that arrived must be the one this rank's schedule says comes next."""
    if message.g != item.g or message.batch.sample_ids.tolist() != item.members:
        raise ChannelError(
            f"drafter rank {rank}: expected global batch {item.g} with samples {item.members[:8]}..., got batch "
            f"{message.g} with samples {message.batch.sample_ids.tolist()[:8]}... from rank {message.source}: "
            "the ranks disagree about the data (different --data files or settings per rank?)"
        )
    return message


def train_drafter(ctx: DistributedContext, run: Run, source) -> bool:
    """The drafter's loop: take A micro-batches, one optimizer step, log and save on the leader.

    On SIGTERM/SIGINT every drafter rank finishes the step it is in, the leader saves, the targets are
    told to stop and the channel is drained. Returns whether the run stopped early."""
    topo, device, cfg, schedule = ctx.topology, ctx.device, run.cfg, run.schedule
    out = Path(cfg.output_dir)
    head = SharedTargetHead.from_target(run.setup.info).to(device=device, dtype=compute_dtype(device))
    drafter = build_drafter(run.setup.drafter_config, cfg.seed, device)
    attention = cfg.attention if cfg.attention != "auto" else ("flex" if device.type == "cuda" else "sdpa")
    settings = StepSettings(
        cfg.num_anchors, cfg.seed, cfg.max_grad_norm, cfg.loss_chunk_size, attention, cfg.loss_gamma
    )
    optim = OptimizerSettings(cfg.learning_rate, cfg.weight_decay, cfg.warmup_ratio, schedule.total_steps)
    group = ctx.drafter_group if topo.num_drafters > 1 else None
    trainer = DrafterTrainer(drafter, head, settings, optim, group)
    tokens_seen = restore(run, trainer, topo.rank) if run.resume_from else 0
    monitor = TrainingMonitor(out, schedule.total_steps, run.start_step) if topo.is_leader else None
    protect = {run.resume_from.name} if run.resume_from else set()
    writer = CheckpointWriter(out, cfg.save_total_limit, protect, monitor.print) if monitor else None
    compute_s, senders = 0.0, {}  # compute_s: time inside trainer.step
    stop, stopping = GracefulStop().install(), False

    def mark() -> dict:  # counters at the start of a logging window
        return {
            "start": time.perf_counter(),
            "tokens": 0.0,
            "wait": source.wait_s,
            "bytes": source.bytes_received,
            "compute": compute_s,
        }

    window = mark()
    expected = (
        item
        for item in schedule.batches(run.first_batch, run.end_batch)
        if topo.drafter_of(item.g) == topo.rank
    )
    try:
        for step in range(run.start_step + 1, schedule.total_steps + 1):
            messages = [
                check_batch(source.get(), next(expected), topo.rank)
                for _ in range(cfg.gradient_accumulation_steps)
            ]
            if not topo.colocated:
                senders.update({m.source: (m.sender_wait_s, m.sender_inflight) for m in messages})
            step_start = time.perf_counter()
            metrics = trainer.step([(m.batch, m.features, m.epoch) for m in messages])
            compute_s += time.perf_counter() - step_start
            # One all-reduce carries the step's tokens and whether any drafter rank was asked to stop,
            # so that every drafter rank stops after the same step.
            step_tokens, stop_votes = trainer.sum_over_drafters(
                torch.tensor([float(sum(m.batch.num_tokens for m in messages)), float(stop.requested)])
            ).tolist()
            stopping = stop_votes > 0
            tokens_seen += int(step_tokens)
            window["tokens"] += step_tokens
            if step % cfg.logging_steps == 0 or step == schedule.total_steps:
                elapsed = time.perf_counter() - window["start"]
                stats = trainer.sum_over_drafters(
                    torch.tensor([source.wait_s - window["wait"], source.bytes_received - window["bytes"]])
                )
                metrics.update(
                    epoch=messages[-1].epoch,
                    tokens_seen=tokens_seen,
                    tokens_per_s=window["tokens"] / elapsed,
                    wait_fraction=float(stats[0]) / topo.num_drafters / elapsed,
                    hidden_state_bytes_per_s=float(stats[1]) / elapsed,
                    outside_compute_fraction=1.0 - (compute_s - window["compute"]) / elapsed,
                    target_send_wait_s={str(k): round(v[0], 3) for k, v in sorted(senders.items())},
                    target_inflight={str(k): v[1] for k, v in sorted(senders.items())},
                )
                if monitor:
                    monitor.log(metrics)
                window = mark()
            if topo.is_leader and (step % cfg.save_steps == 0 or step == schedule.total_steps or stopping):
                trainer_state = run.identity | {
                    "global_step": step,
                    "epoch": messages[-1].epoch,
                    "batches_consumed": run.first_batch + (step - run.start_step) * schedule.batches_per_step,
                    "tokens_seen": tokens_seen,
                    "topology": {
                        "world_size": topo.world_size,
                        "target_ranks": topo.num_targets,
                        "drafter_ranks": topo.num_drafters,
                        "colocated": topo.colocated,
                    },
                }
                writer.save(
                    step,
                    drafter,
                    trainer.optimizer,
                    trainer.scheduler,
                    trainer_state,
                    {topo.rank: rng_state()},
                )
            if stopping:
                if monitor:
                    monitor.print(
                        f"stop requested ({stop.signal_name or 'another rank'}): stopped after step {step}"
                    )
                break
        if stopping:
            source.drain()
            if group is not None:  # every drafter rank drops incoming batches before any target stops
                dist.barrier(group=group)
            if topo.is_leader and not topo.colocated:
                StopFlag().set()
        source.close()
        if writer:
            writer.wait()  # the last checkpoint is on disk before the job reports success
            monitor.print(f"checkpoint saves paused training for {writer.stall_s:.2f} s in total")
    finally:
        if writer:
            writer.wait(raise_error=False)
        if monitor:
            monitor.close()
    return stopping


ROLES = {"colocated": run_colocated, "target": run_target, "drafter": run_drafter}


# ---------------------------------------------------------------------------------------------- main


def decide_start(run: Run, topology: Topology) -> list[str]:
    """On the leader: find the checkpoint to resume from and check it belongs to this run.

    Sets run.start_step / run.resume_from; returns lines to print (skipped checkpoints, overrides).
    """
    notes: list[str] = []
    path = find_checkpoint(run.cfg.output_dir, run.cfg.resume, notes.append)
    if path is None:
        return notes
    saved = load_trainer_state(path)
    saved_batch, drafters = saved["config"].get("global_batch"), topology.num_drafters
    if (
        isinstance(saved_batch, int)
        and saved_batch != run.identity["config"]["global_batch"]
        and "global_batch" not in run.cfg.resume_override
        and saved_batch % drafters == 0
    ):  # another number of drafter ranks: keep the global batch by changing the accumulation
        run.set_accumulation(saved_batch // drafters, topology)
        notes.append(
            f"keeping the checkpoint's global batch of {saved_batch} batches: {drafters} drafter rank(s) x "
            f"--gradient_accumulation_steps {run.cfg.gradient_accumulation_steps}"
        )
    accepted = check_same_run(saved, run.identity, run.cfg.resume_override, path)
    notes += [f"resume override accepted: {change}" for change in accepted]
    if saved["global_step"] > run.schedule.total_steps:
        raise ValueError(
            f"{path} is at step {saved['global_step']}, past this run's {run.schedule.total_steps} steps"
        )
    run.start_step, run.first_batch, run.resume_from = (
        int(saved["global_step"]),
        int(saved["batches_consumed"]),
        path,
    )
    notes += set_aside_later(run.cfg.output_dir, path, run.start_step)
    notes.append(
        f"resuming from {path} (step {run.start_step}, batch {run.first_batch}; saved as "
        f"{saved['topology']['target_ranks']}+{saved['topology']['drafter_ranks']}, now "
        f"{topology.num_targets}+{topology.num_drafters})"
    )
    return notes


def check_same_data(ctx: DistributedContext, run: Run) -> None:
    """Every rank must train on the same tokenized data: compare the data fingerprints of all ranks."""
    if ctx.topology.colocated:
        return
    mine = torch.tensor([int(run.identity["fingerprints"]["data"][:15], 16)], dtype=torch.int64)
    everyone = [torch.zeros_like(mine) for _ in range(ctx.topology.world_size)]
    dist.all_gather(everyone, mine)
    values = [int(t) for t in everyone]
    if len(set(values)) > 1:
        odd = [rank for rank, value in enumerate(values) if value != values[ctx.topology.drafter_ranks[0]]]
        raise ValueError(
            f"rank(s) {odd} tokenized other data than the drafter leader (rank {ctx.topology.drafter_ranks[0]}): "
            "every rank must see the same --data files, tokenizer, template and settings"
        )


def share_start(ctx: DistributedContext, run: Run, error: str | None) -> None:
    """Every rank learns the leader's decision (start step and accumulation, or that the run must stop)."""
    topo = ctx.topology
    if topo.colocated:
        if error:
            raise ValueError(error)
        return
    decision = torch.tensor(
        [run.start_step, 1 if error else 0, run.cfg.gradient_accumulation_steps, run.first_batch],
        dtype=torch.int64,
    )
    dist.broadcast(decision, src=topo.drafter_ranks[0])
    if int(decision[1]):
        raise ValueError(error or f"rank {topo.drafter_ranks[0]} refused to start (see its message)")
    if int(decision[2]) != run.cfg.gradient_accumulation_steps:
        run.set_accumulation(int(decision[2]), topo)
    run.start_step, run.first_batch = int(decision[0]), int(decision[3])
    if run.start_step and not topo.is_leader:  # other drafter ranks read the same checkpoint
        resume = run.cfg.resume
        root = Path(resume) if resume not in ("auto", "never") else Path(run.cfg.output_dir) / "checkpoints"
        run.resume_from = root if resume not in ("auto", "never") else root / checkpoint_name(run.start_step)


def prune_metrics(output_dir: str, start_step: int) -> None:
    """Drop metrics.jsonl lines after the resume point (a killed run may have logged past its checkpoint)."""
    path = Path(output_dir) / "metrics.jsonl"
    if path.is_file():
        kept = [line for line in path.read_text().splitlines() if json.loads(line)["step"] <= start_step]
        path.write_text("".join(line + "\n" for line in kept))


def run_final_evaluation(cfg: TrainConfig, device: torch.device) -> None:
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
        device=str(device),
        chat_template=cfg.chat_template,
        template_kwargs=cfg.chat_template_kwargs,
    )
    print_report(report)
    (Path(cfg.output_dir) / "eval.json").write_text(json.dumps(report, indent=2) + "\n")


def lost_peer(error: RuntimeError) -> bool:
    """Whether a collective failed because another rank went away (gloo and NCCL word it differently)."""
    text = str(error)
    return isinstance(error, dist.DistBackendError) or any(
        sign in text for sign in ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--help" in argv or "-h" in argv:
        print(usage())
        return 0
    rank, world, _ = env_world()
    where = "" if world == 1 else f" (rank {rank})"
    try:
        cfg, embedded = parse_config(argv)
        topology = Topology(world, rank, cfg.drafter_ranks)
        leader = topology.is_leader
        if embedded and leader:
            print(f"no --target_model given: training the embedded default (tiny target {cfg.target_model})")
        setup = prepare(cfg)
        if cfg.plan:
            if leader:
                print_plan(cfg, setup, topology)
            return 0
        data, stats = load_data(cfg, setup, where)
        schedule = build_schedule(cfg, data, topology)
        run = Run(cfg, setup, data, schedule, run_identity(cfg, setup, data, topology))
        ctx = init_distributed(cfg.drafter_ranks, cfg.device, cfg.dist_timeout)
    except ValueError as e:
        print(f"error{where}: {e}", file=sys.stderr)
        return 2
    try:
        check_same_data(ctx, run)
        error = None
        if leader:
            try:
                for note in decide_start(run, topology):
                    print(note)
            except (
                ValueError,
                KeyError,
                OSError,
                json.JSONDecodeError,
            ) as e:  # refuse on every rank, not only here
                error = str(e) if isinstance(e, ValueError) else f"cannot resume: {type(e).__name__}: {e}"
        share_start(ctx, run, error)
    except ValueError as e:
        print(f"error{where}: {e}", file=sys.stderr)
        shutdown()
        return 2
    torch.manual_seed(cfg.seed)
    if leader:
        out = Path(cfg.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        prune_metrics(cfg.output_dir, run.start_step)
        (out / "data_stats.json").write_text(json.dumps(asdict(stats), indent=2) + "\n")
        (out / "config.json").write_text(json.dumps(config_to_dict(run.cfg), indent=2) + "\n")
        print(
            f"data: {stats.summary()}; "
            f"{run.schedule.total_steps} steps of {run.schedule.batches_per_step} batches"
        )
    start = time.perf_counter()
    try:
        stopped = ROLES[topology.role](ctx, run)
    except (ChannelError, SaveError) as e:  # a dead or stuck peer, a full disk: say so, no traceback
        print(f"error{where}: {e}", file=sys.stderr)
        return 1
    except RuntimeError as e:
        if not lost_peer(e):
            raise  # a bug: keep its traceback
        print(
            f"error{where}: lost the connection to another rank of the job, which most likely failed first "
            f"(see its message above): {str(e).splitlines()[0]}",
            file=sys.stderr,
        )
        return 1
    finally:
        shutdown()
    if leader:
        print(
            f"training took {time.perf_counter() - start:.0f} s; checkpoints in {cfg.output_dir}/checkpoints"
        )
        if cfg.eval_data and not stopped:
            run_final_evaluation(cfg, ctx.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
