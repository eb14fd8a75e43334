"""Entry point: `torchrun --nproc-per-node N -m dflash_ddp.train [--config FILE.yaml] [--key value ...]`.

Also `python -m dflash_ddp.train` (one colocated process) and `accelerate launch -m dflash_ddp.train`.
With no arguments it trains a drafter for the tiny target shipped in the package and ends by measuring
tau with real speculative decoding on held-out conversations.

A rank's role picks its loop here, once: `run_target` (compute features, send them), `run_drafter`
(receive, train, save) or `run_colocated` (both in one process). The drafter's loop is the same
function in both training roles; only where its batches come from differs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from .calibrate import (
    RandomFeatures,
    Rates,
    calibration_batches,
    calibration_steps,
    measure_rates,
    report,
    time_target_forward,
)
from .checkpoint import (
    CheckpointWriter,
    SaveError,
    describe_error,
    drafter_rng_states,
    remove_leftovers,
    resolve_checkpoint,
)
from .cli_help import usage
from .config import TrainConfig, config_to_dict, parse_config
from .memory import peak_resident_bytes
from .progress import TrainingMonitor
from .resume import RestoreError, load_tensor_file, load_trainer_state, load_weights, restore_rng
from .run_lock import OutputDirLock
from .run_setup import (
    Run,
    RunSetup,
    build_schedule,
    check_memory,
    check_same_data,
    decide_start,
    load_data,
    prepare,
    print_plan,
    prune_metrics,
    run_device,
    run_identity,
    share_start,
)
from .schedule import ScheduledBatch
from .signals import GracefulStop
from .target import SharedTargetHead, TargetFeatureExtractor
from .tensor_parallel import tp_group
from .topology import DistributedContext, Topology, env_world, init_distributed, job_barrier, shutdown
from .trackers import Trackers, resolve_report_to
from .trainer import (
    DrafterTrainer,
    OptimizerSettings,
    StepSettings,
    build_drafter,
    compute_dtype,
    resolve_attention,
)
from .transport import ChannelError, ChannelReceiver, ChannelSender, Message, PeerLost, StopFlag
from .watch import prune_evaluations


def peak_memory_bytes(device: torch.device) -> int:
    """This process's peak so far: allocated tensors on CUDA, resident memory on the CPU (to set against
    --plan's prediction)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return peak_resident_bytes()


# --------------------------------------------------------------------------------------------- roles


def run_target(ctx: DistributedContext, run: Run) -> bool:
    """A target rank: compute the tapped features of its group's batches (g = group mod G) and, on the
    group's first rank, send each to its drafter.

    The drafter leader decides when the job stops: a signal here is passed on to it (through the job's
    store), and the loop ends early when the leader, having saved, raises the stop flag. The ranks of a
    tensor-parallel group agree before each batch, since a rank that left alone would leave the others
    waiting in the batch's all-reduces."""
    topo = ctx.topology
    signalled = GracefulStop().install()
    stop, told = StopFlag(), False
    extractor = TargetFeatureExtractor(
        run.setup.info,
        run.setup.drafter_config.target_layer_ids,
        ctx.device,
        compute_dtype(ctx.device),
        ctx.target_meshes,
    )
    sends = topo.rank in topo.sender_ranks
    sender = ChannelSender(topo.rank, run.cfg.max_inflight, ctx.channel_device) if sends else None
    group = tp_group(ctx.target_meshes) if ctx.target_meshes is not None else None
    pad_id = run.setup.tokenizer.pad_token_id or 0
    job_barrier("channel-open")  # every drafter rank has built, restored and warmed up its drafter
    for item in run.schedule.batches(run.first_batch, run.end_batch):
        if topo.group_of(item.g) != topo.group:
            continue
        if signalled.requested and not told:  # e.g. a scheduler preempting only this node
            stop.request(f"{signalled.signal_name} on rank {topo.rank}")
            told = True
        if group_agrees_to_stop(stop.is_set(), group):
            break
        batch = run.data.batch(item.members, pad_id)
        features = extractor(batch.input_ids.to(ctx.device), batch.attention_mask.to(ctx.device))
        if sender:
            sender.send(topo.drafter_of(item.g), batch, features, item.g, item.epoch)
    if sender:
        sender.close(topo.drafter_ranks)
    job_barrier("channel-closed")  # every drafter rank has received its END: nothing is left in flight
    return False


def group_agrees_to_stop(stop: bool, group) -> bool:
    """Whether any rank of this tensor-parallel group saw the stop flag (each rank alone without one)."""
    if group is None:
        return stop
    flag = torch.tensor([int(stop)])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())


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
    """One process: the target runs here and feeds the drafter's loop directly."""
    extractor = TargetFeatureExtractor(
        run.setup.info, run.setup.drafter_config.target_layer_ids, ctx.device, compute_dtype(ctx.device)
    )
    return train_drafter(ctx, run, lambda: LocalTarget(extractor, run))


def run_drafter(ctx: DistributedContext, run: Run) -> bool:
    """A drafter rank: receive the batches g = rank mod M from their target ranks and train on them.

    The channel opens only once the drafter is ready to train (built, restored, warmed up) and every rank
    has reached the same point, so that no send waits on set-up; it is torn down only after every END has
    been received."""
    topo = ctx.topology
    mine = [
        (g, topo.target_of(g))
        for g in range(run.first_batch, run.end_batch)
        if topo.drafter_of(g) == topo.rank
    ]

    def open_channel() -> ChannelReceiver:
        job_barrier("channel-open")
        return ChannelReceiver(
            topo.rank, mine, topo.sender_ranks, ctx.device, compute_dtype(ctx.device), ctx.channel_device
        )

    stopped = train_drafter(ctx, run, open_channel)
    job_barrier("channel-closed")
    return stopped


def build_trainer(
    cfg: TrainConfig, setup: RunSetup, device: torch.device, total_steps: int, group=None
) -> DrafterTrainer:
    """A freshly initialised drafter with the target's shared head, AdamW and the schedule, as configured."""
    head = SharedTargetHead.from_target(setup.info).to(device=device, dtype=compute_dtype(device))
    drafter = build_drafter(setup.drafter_config, cfg.seed, device)
    drafter.gradient_checkpointing = setup.memory.checkpointing
    attention = resolve_attention(cfg.attention, device)
    settings = StepSettings(
        cfg.num_anchors,
        cfg.seed,
        cfg.max_grad_norm,
        cfg.loss_chunk_size,
        attention,
        cfg.drafter_chunk_tokens,
        cfg.loss_gamma,
    )
    optim = OptimizerSettings(cfg.learning_rate, cfg.weight_decay, cfg.warmup_ratio, total_steps)
    return DrafterTrainer(drafter, head, settings, optim, group)


def restore(run: Run, trainer: DrafterTrainer, drafter_index: int) -> int:
    """Load weights, optimizer, scheduler and RNG from the resume checkpoint; returns tokens seen.

    The RNG file is chosen by the rank's index among the drafter ranks, not its global rank: a resume with
    another number of target ranks moves the drafters' global ranks. Any failure is a RestoreError."""
    path = run.resume_from
    try:
        load_weights(path, trainer.drafter)
        trainer.optimizer.load_state_dict(load_tensor_file(path / "optimizer.pt"))
        trainer.scheduler.load_state_dict(load_tensor_file(path / "scheduler.pt"))
        restore_rng(path, drafter_index)
        tokens_seen = int(load_trainer_state(path)["tokens_seen"])
    except (ValueError, KeyError, TypeError, RuntimeError) as e:  # a state that does not fit the objects
        raise RestoreError(f"cannot resume from {path}: {describe_error(e, with_type=False)}") from None
    # The loaded states carry the checkpoint's lr and weight decay; this run's settings win (they differ
    # only when the user accepted the change with --resume_override).
    cfg, scheduler = run.cfg, trainer.scheduler
    scheduler.base_lrs = [cfg.learning_rate for _ in scheduler.base_lrs]
    for group, schedule_fn in zip(trainer.optimizer.param_groups, scheduler.lr_lambdas, strict=True):
        group.update(initial_lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
        group["lr"] = cfg.learning_rate * schedule_fn(scheduler.last_epoch)
    trainer.global_step = run.start_step
    return tokens_seen


def check_batch(message: Message, item: ScheduledBatch, rank: int) -> Message:
    """Lockstep safety: the batch that arrived must be the one this rank's schedule says comes next."""
    if message.g != item.g or message.batch.sample_ids.tolist() != item.members:
        raise ChannelError(
            f"drafter rank {rank}: expected global batch {item.g} with samples {item.members[:8]}..., got batch "
            f"{message.g} with samples {message.batch.sample_ids.tolist()[:8]}... from rank {message.source}: "
            "the ranks disagree about the data (different --data files or settings per rank?)"
        )
    return message


def train_drafter(ctx: DistributedContext, run: Run, open_source) -> bool:
    """The drafter's loop: take A micro-batches, one optimizer step, log and save on the leader.

    `open_source()` gives the batches (the channel, or the target in this process); it is called once the
    drafter is built, restored and, in a split job, warmed up.

    On SIGTERM/SIGINT every drafter rank finishes the step it is in, the leader saves, the targets are
    told to stop and the channel is drained. Returns whether the run stopped early."""
    topo, device, cfg, schedule = ctx.topology, ctx.device, run.cfg, run.schedule
    out = Path(cfg.output_dir)
    group = ctx.drafter_group if topo.num_drafters > 1 else None
    trainer = build_trainer(cfg, run.setup, device, schedule.total_steps, group)
    drafter = trainer.drafter
    drafter_index = topo.drafter_ranks.index(topo.rank)
    tokens_seen = restore(run, trainer, drafter_index) if run.resume_from else 0
    if not topo.colocated:
        trainer.warm_up()
    source = open_source()
    monitor = (
        TrainingMonitor(out, schedule.total_steps, run.start_step, run.trackers) if topo.is_leader else None
    )
    protect = {run.resume_from.name} if run.resume_from else set()
    writer = CheckpointWriter(out, cfg.save_total_limit, protect, monitor.print) if monitor else None
    compute_s, senders = 0.0, {}  # compute_s: time inside trainer.step
    stop, stopping = GracefulStop().install(), False
    # signals delivered to other ranks (a target node's preemption) reach the leader through the store
    requests = StopFlag() if topo.is_leader and not topo.colocated else None

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
            if writer:
                writer.check()  # a failed background save stops the run now, not at the next save
            messages = [
                check_batch(source.get(), next(expected), topo.rank)
                for _ in range(cfg.gradient_accumulation_steps)
            ]
            if not topo.colocated:
                senders.update({m.source: (m.sender_wait_s, m.sender_inflight) for m in messages})
            step_start = time.perf_counter()
            result = trainer.step([(m.batch, m.features, m.epoch) for m in messages])
            compute_s += time.perf_counter() - step_start
            # One all-reduce carries the step's tokens and whether any drafter rank was asked to stop,
            # so that every drafter rank stops after the same step.
            requested_by = stop.signal_name or (requests.requested() if requests else "")
            step_tokens, stop_votes = trainer.sum_over_drafters(
                torch.tensor([float(sum(m.batch.num_tokens for m in messages)), float(bool(requested_by))])
            ).tolist()
            stopping = stop_votes > 0
            tokens_seen += int(step_tokens)
            window["tokens"] += step_tokens
            if step % cfg.logging_steps == 0 or step == schedule.total_steps:
                elapsed = time.perf_counter() - window["start"]
                stats = trainer.sum_over_drafters(
                    torch.tensor([source.wait_s - window["wait"], source.bytes_received - window["bytes"]])
                )
                trainer.check_finite()
                metrics = result.metrics()
                metrics.update(
                    epoch=messages[-1].epoch,
                    tokens_seen=tokens_seen,
                    tokens_per_s=window["tokens"] / elapsed,
                    wait_fraction=float(stats[0]) / topo.num_drafters / elapsed,
                    hidden_state_bytes_per_s=float(stats[1]) / elapsed,
                    outside_compute_fraction=1.0 - (compute_s - window["compute"]) / elapsed,
                    peak_memory_gib=peak_memory_bytes(device) / 2**30,
                    target_send_wait_s={str(k): round(v[0], 3) for k, v in sorted(senders.items())},
                    target_inflight={str(k): v[1] for k, v in sorted(senders.items())},
                )
                if monitor:
                    monitor.log(metrics)
                window = mark()
            saving = step % cfg.save_steps == 0 or step == schedule.total_steps or stopping
            rng_states = drafter_rng_states(group) if saving else {}  # every drafter rank takes part
            if saving:
                trainer.check_finite()  # never a checkpoint of weights a non-finite step touched
            if topo.is_leader and saving:
                trainer_state = run.identity | {
                    "global_step": step,
                    "total_steps": schedule.total_steps,  # how an evaluation watcher knows the run's end
                    "epoch": messages[-1].epoch,
                    "batches_consumed": run.first_batch + (step - run.start_step) * schedule.batches_per_step,
                    "tokens_seen": tokens_seen,
                    "topology": {
                        "world_size": topo.world_size,
                        "target_ranks": topo.num_targets,
                        "target_tp_size": topo.tp_size,
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
                    rng_states,
                )
            if stopping:
                if monitor:
                    monitor.print(
                        f"stop requested ({requested_by or 'on another drafter rank'}): stopped after step {step}"
                    )
                break
        if stopping:
            source.drain()
            if group is not None:  # every drafter rank drops incoming batches before any target stops
                dist.barrier(group=group)
            if requests is not None:  # the drafter leader of a split job: the targets stop
                requests.set()
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


def calibrate_split(cfg: TrainConfig, setup: RunSetup, topology: Topology, where: str) -> None:
    """--plan --calibrate, on the drafter leader: time one target rank's and one drafter rank's work on this
    process's device with the first batches of the run's schedule, then print the split that trains fastest.
    A fresh drafter trains a few steps; nothing is restored or saved (the tokenized data cache is kept).
    With tensor-parallel groups the first group times its own forward (calibrate_group_split)."""
    if topology.tp_size > 1:
        calibrate_group_split(cfg, setup, where)
        return
    data, _ = load_data(cfg, setup, where)
    device = run_device(cfg)
    taps = setup.drafter_config.target_layer_ids
    extractor = TargetFeatureExtractor(setup.info, taps, device, compute_dtype(device))
    trainer = build_trainer(cfg, setup, device, calibration_steps(device))
    measurement = measure_rates(
        calibration_schedule(cfg, setup, data, device), extractor, trainer, cfg.gradient_accumulation_steps
    )
    print_calibration(measurement, topology, trainer, device)


def calibration_schedule(cfg: TrainConfig, setup: RunSetup, data, device: torch.device):
    """The (batch, epoch) pairs a calibration times: the first of the run's own schedule."""
    pad_id = setup.tokenizer.pad_token_id or 0
    return calibration_batches(
        data,
        cfg.tokens_per_batch,
        cfg.seed,
        cfg.gradient_accumulation_steps,
        pad_id,
        calibration_steps(device),
    )


def print_calibration(measurement, topology: Topology, trainer: DrafterTrainer, device) -> None:
    """The calibration's report (calibrate.report) for this launch's topology."""
    gradient_bytes = sum(p.numel() * p.element_size() for p in trainer.drafter.parameters())
    for line in report(
        measurement, topology.world_size, device, topology.num_drafters, gradient_bytes, topology.tp_size
    ):
        print(line)


def calibrate_group_split(cfg: TrainConfig, setup: RunSetup, where: str) -> None:
    """--plan --calibrate with --target_tp_size N, on every rank: the ranks of target group 0 load their
    shards and time the group's forward together; then the drafter leader times its steps on random
    features (a group's target does not fit it) and prints the split, a group counting as one target unit."""
    ctx = init_distributed(
        cfg.drafter_ranks, cfg.device, cfg.dist_timeout, cfg.channel_backend, cfg.target_tp_size
    )
    topo, device, store = ctx.topology, ctx.device, dist.distributed_c10d._get_default_store()
    try:
        measures_target = topo.role == "target" and topo.group == 0
        data = load_data(cfg, setup, where)[0] if measures_target or topo.is_leader else None
        if measures_target:
            taps = setup.drafter_config.target_layer_ids
            extractor = TargetFeatureExtractor(
                setup.info, taps, device, compute_dtype(device), ctx.target_meshes
            )
            timed = time_target_forward(
                calibration_schedule(cfg, setup, data, device), extractor, cfg.gradient_accumulation_steps
            )
            if topo.rank == topo.group_ranks(0)[0]:
                store.set("dflash_ddp/calibrate/group", json.dumps(timed))
        job_barrier("calibrate-target")  # the drafter's timing starts after the group's: no shared cores
        if topo.is_leader:
            sequences, target_s = json.loads(store.get("dflash_ddp/calibrate/group"))
            width = len(setup.drafter_config.target_layer_ids) * setup.info.hidden_size
            features = RandomFeatures(width, device, compute_dtype(device))
            trainer = build_trainer(cfg, setup, device, calibration_steps(device))
            drafter = measure_rates(
                calibration_schedule(cfg, setup, data, device),
                features,
                trainer,
                cfg.gradient_accumulation_steps,
            )
            measurement = dataclasses.replace(
                drafter, rates=Rates(sequences / target_s, drafter.rates.drafter), target_s=target_s
            )
            print_calibration(measurement, topo, trainer, device)
        job_barrier("calibrate-done")
    finally:
        shutdown()


def start_watcher(cfg: TrainConfig, device: torch.device) -> subprocess.Popen:
    """--eval_steps: the evaluation watcher as a background process of the drafter leader (see watch.py)."""
    from .watch import LOG_FILE, start_in_job

    out = Path(cfg.output_dir)
    print(
        f"real tau every {cfg.eval_steps} steps: evaluated in the background (python -m dflash_ddp.evaluate "
        f"--watch {out}; log in {out / LOG_FILE}) into {out / 'eval.jsonl'} and {out / 'checkpoints' / 'best'}"
    )
    return start_in_job(out, device, out / LOG_FILE)


def finish_watcher(watcher: subprocess.Popen, stopped: bool, out: Path) -> None:
    """Wait for the watcher to evaluate the final checkpoint (a stopped run: end it now), then summarise."""
    from .watch import best_record, read_evaluations

    if stopped:
        watcher.terminate()
    else:
        print("waiting for the background evaluation of the last checkpoint")
    if watcher.wait() and not stopped:
        print(
            f"the background evaluation failed (exit status {watcher.returncode}); see {out / 'eval_watch.log'}"
        )
    records, _ = read_evaluations(out)
    if records:
        taus = ", ".join(f"{r['step']}: {r['tau']:.2f}" for r in records if r["tau"] is not None)
        best = best_record(records)
        print(f"real tau per evaluated step: {taus}" + (f"; best {best['checkpoint']}" if best else ""))


def run_final_evaluation(cfg: TrainConfig, device: torch.device) -> dict:
    """Measure tau with real speculative decoding on held-out conversations, against baselines."""
    from .evaluate import evaluate, print_report

    checkpoint = resolve_checkpoint(Path(cfg.output_dir))
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
    return report


def close_trackers(trackers: Trackers, out: Path, report: dict | None) -> None:
    """Send what arrived after the last logged step (the background evaluation of the final checkpoint, the
    final evaluation's report as final_eval/...) at that step, then close the trackers."""
    from .watch import read_evaluations

    for record in read_evaluations(out)[0]:
        if record["step"] not in trackers.evaluated:
            trackers.log_eval(trackers.last_step, record)
    if report:
        trackers.log(report, step=trackers.last_step, prefix="final_eval/")
    trackers.finish()


def lost_peer(error: RuntimeError) -> bool:
    """Whether a collective failed because another rank went away (gloo and NCCL word it differently).

    Matched on the message, not on the type: NCCL raises DistBackendError for its own bugs and out-of-memory
    too, and those must keep their traceback."""
    signs = (
        "Connection closed by peer",
        "Connection reset by peer",
        "Broken pipe",
        "remote process exited",
        "NCCL communicator was aborted",
    )
    return any(sign in str(error) for sign in signs)


# How long a rank that failed only because another rank did waits before exiting: longer than torchrun's
# 0.1 s monitor interval, so that torchrun records the first failure first and names it the root cause.
CONSEQUENCE_DELAY_S = 1.0


def fail(
    message: str, code: int, split: bool, consequence: bool = False, lock: OutputDirLock | None = None
) -> int:
    """Print this rank's one-line error and end the rank with `code`.

    In a split job the rank exits at once without tearing down the process group: the drafter's receiver
    thread may be blocked in a receive, and destroying the group under it aborts the process (SIGABRT,
    'terminate called without an active exception') after this message, and torchrun then blames another
    rank. A rank failing only as a `consequence` of another's failure first waits CONSEQUENCE_DELAY_S
    (torchrun's SIGTERM ends the wait at once). A background checkpoint write still in flight has been
    waited for by the loop's own cleanup before this point. The output directory's `lock` is released
    first: exiting skips `main`'s release, and a lock file still naming this job would make the next job
    report taking it over from one that ended without releasing it. The message also goes to torchrun's
    error file (write_error_file) unless this rank fails only as a consequence."""
    print(message, file=sys.stderr, flush=True)
    if not split:
        return code
    if not consequence:  # a consequence's file could make torchrun blame it instead of the rank that failed
        write_error_file(message)
    if lock:
        lock.release()
    if consequence:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
        time.sleep(CONSEQUENCE_DELAY_S)
    sys.stdout.flush()
    os._exit(code)


# How long a rank other than the first waits before printing its refusal to start. Under torchrun every rank
# usually reaches the same refusal (each parses the same flags and reads the same files); the first one
# exits at once and torchrun (0.1 s monitor interval) ends the others within this wait, so the line is
# printed once. A refusal that only this rank reaches (its GPU, its node's files) is still printed, later.
REFUSAL_ECHO_DELAY_S = 3.0


def write_error_file(message: str) -> bool:
    """Under torchrun, put `message` in this rank's error file, which torchrun shows as the "Root Cause"
    of its failure summary instead of "<N/A>"; False without torchrun."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")  # set by torchrun for each worker
    if not error_file:
        return False
    # the layout torchrun's ErrorHandler writes; its summary prints extraInfo.py_callstack
    info = {"py_callstack": message, "timestamp": str(int(time.time()))}
    with contextlib.suppress(OSError):
        Path(error_file).write_text(json.dumps({"message": {"message": message, "extraInfo": info}}))
    return True


def refuse(message: str, first: bool, split: bool, lock: OutputDirLock | None = None) -> int:
    """A refusal at start: `message` on stderr, exit status 2, printed once per job in a split job (see
    REFUSAL_ECHO_DELAY_S). Under torchrun the line also goes to this rank's error file, which torchrun shows
    as the "Root Cause" at the end of its failure summary (below its own traceback), and the rank exits at
    once (a normal interpreter exit takes seconds, in which the other ranks would print the line too),
    releasing the output directory's `lock` first as `fail` does."""
    if split and not first:
        time.sleep(REFUSAL_ECHO_DELAY_S)
    print(message, file=sys.stderr, flush=True)
    if split and write_error_file(message):
        if lock:
            lock.release()
        sys.stdout.flush()
        os._exit(2)
    return 2


def start_trackers(cfg: TrainConfig, start_step: int) -> Trackers | None:
    """--report_to: the experiment trackers, started (with the config) before any training step."""
    names = resolve_report_to(cfg.report_to)
    if not names:
        return None
    trackers = Trackers.start(names, cfg.run_name, cfg.output_dir, config_to_dict(cfg), start_step)
    print(f"reporting metrics to {', '.join(names)} (under {cfg.output_dir})")
    return trackers


def main(argv: list[str] | None = None) -> int:
    """CLI: 0 on success (or a clean stop), 2 on bad input or a refused resume, 1 when a peer or the disk fails."""
    argv = sys.argv[1:] if argv is None else argv
    rank, world, local_rank = env_world()
    if "--help" in argv or "-h" in argv:
        if local_rank == 0:  # once per node under torchrun
            print(usage(argv))
        return 0
    where = "" if world == 1 else f" (rank {rank})"
    try:
        cfg, embedded = parse_config(argv)
        topology = Topology(world, rank, cfg.drafter_ranks, cfg.target_tp_size)
        leader = topology.is_leader
        if embedded and leader:
            print(f"no --target_model given: training the embedded default (tiny target {cfg.target_model})")
        # only the drafter leader plans and measures, unless a tensor-parallel group must time its forward
        group_calibration = cfg.calibrate and topology.tp_size > 1
        if cfg.plan and not leader and not group_calibration:
            return 0
        setup = prepare(cfg, topology)
        if cfg.plan:
            if leader:
                print_plan(cfg, setup, topology)
            if cfg.calibrate:
                calibrate_split(cfg, setup, topology, where)
            return 0
        check_memory(cfg, setup)
        data, stats = load_data(cfg, setup, where)
        schedule = build_schedule(cfg, data, topology)
        run = Run(cfg, setup, data, schedule, run_identity(cfg, setup, data, topology))
        ctx = init_distributed(
            cfg.drafter_ranks, cfg.device, cfg.dist_timeout, cfg.channel_backend, cfg.target_tp_size
        )
    except ValueError as e:
        return refuse(f"error{where}: {e}", first=local_rank == 0, split=world > 1)
    lock = OutputDirLock(cfg.output_dir) if leader else None
    try:
        return train(ctx, run, stats, lock, where)
    finally:
        if lock:
            lock.release()


def train(ctx: DistributedContext, run: Run, stats, lock: OutputDirLock | None, where: str) -> int:
    """Agree on the start, train in this rank's role, evaluate; the exit status of `main`."""
    cfg, topology, leader = run.cfg, ctx.topology, ctx.topology.is_leader
    try:
        check_same_data(ctx, run)
        error = None
        if leader:
            try:
                # the lock before anything in the directory is read or changed: two jobs would both resume
                # the same checkpoint, and race on rotation, `latest` and metrics.jsonl
                for note in lock.acquire() + remove_leftovers(cfg.output_dir) + decide_start(run, topology):
                    print(note)
                if run.start_step < run.schedule.total_steps:
                    run.trackers = start_trackers(cfg, run.start_step)
            # any failure (a hand-edited trainer_state.json can raise anything) is a refusal on every rank:
            # a leader dying here would leave the others waiting in the broadcast below
            except Exception as e:
                error = str(e) if isinstance(e, ValueError) else f"cannot resume: {type(e).__name__}: {e}"
        share_start(ctx, run, error)
    except ValueError as e:  # the same on every rank, decided by the leader: the leader says it
        shutdown()
        return refuse(f"error{where}: {e}", first=leader, split=not topology.colocated, lock=lock)
    if run.start_step >= run.schedule.total_steps:  # resumed at the last step: nothing left to train
        shutdown()
        if leader:
            print(
                f"already finished at step {run.start_step} (checkpoint {run.resume_from}); to train further, "
                "raise --max_steps or --num_epochs and name it in --resume_override"
            )
            if cfg.eval_data and not (Path(cfg.output_dir) / "eval.json").is_file():
                run_final_evaluation(cfg, ctx.device)  # the job that trained it stopped before evaluating
        return 0
    torch.manual_seed(cfg.seed)
    if leader:
        out = Path(cfg.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        pruned = prune_metrics(cfg.output_dir, run.start_step) + prune_evaluations(
            cfg.output_dir, run.start_step
        )
        for note in pruned:
            print(note)
        (out / "data_stats.json").write_text(json.dumps(asdict(stats), indent=2) + "\n")
        (out / "config.json").write_text(json.dumps(config_to_dict(run.cfg), indent=2) + "\n")
        print(
            f"data: {stats.summary()}; "
            f"{run.schedule.total_steps} steps of {run.schedule.batches_per_step} batches"
        )
    start, split = time.perf_counter(), not topology.colocated
    watcher = start_watcher(cfg, ctx.device) if leader and cfg.eval_steps else None
    trained = False
    try:
        stopped = ROLES[topology.role](ctx, run)
        trained = True
    except RestoreError as e:
        return fail(f"error{where}: {e}", 2, split, lock=lock)
    except PeerLost as e:  # another rank failed first and says why
        return fail(f"error{where}: {e}", 1, split, consequence=True, lock=lock)
    # a full disk, bad numbers, a rank that never came: no traceback
    except (ChannelError, SaveError, FloatingPointError, TimeoutError) as e:
        return fail(f"error{where}: {e}", 1, split, lock=lock)
    except RuntimeError as e:
        if not lost_peer(e):
            raise  # a bug: keep its traceback
        message = (
            f"error{where}: lost the connection to another rank of the job, which most likely failed first "
            f"(see its message above): {' '.join(str(e).split())[:500]}"
        )
        return fail(message, 1, split, consequence=True, lock=lock)
    finally:
        shutdown()
        if run.trackers and not trained:  # a run that trained closes them after its evaluations
            run.trackers.finish()
    if leader:
        print(
            f"training took {time.perf_counter() - start:.0f} s; checkpoints in {cfg.output_dir}/checkpoints"
        )
        if watcher:
            finish_watcher(watcher, stopped, Path(cfg.output_dir))
        report = run_final_evaluation(cfg, ctx.device) if cfg.eval_data and not stopped else None
        if run.trackers:
            close_trackers(run.trackers, Path(cfg.output_dir), report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
