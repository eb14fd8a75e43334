"""Entry point: `torchrun --nproc-per-node N -m dflash_ddp.train [--config FILE.yaml] [--key value ...]`.

Also `python -m dflash_ddp.train` (one colocated process) and `accelerate launch -m dflash_ddp.train`.
With no arguments it trains a drafter for the tiny target shipped in the package and ends by measuring
tau with real speculative decoding on held-out conversations.

A rank's role picks its loop here, once: `run_target` (compute features, send them), `run_drafter`
(receive, train, save) or `run_colocated` (both in one process). The drafter's loop is the same
function in both training roles; only where its batches come from differs.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from dflash_ddp.checkpoint.evaluations import prune_evaluations
from dflash_ddp.checkpoint.resume import RestoreError
from dflash_ddp.checkpoint.writer import removal_note, remove_leftovers, rotate_checkpoints
from dflash_ddp.cli_help import usage
from dflash_ddp.config import TrainConfig, config_to_dict, parse_config
from dflash_ddp.evaluation.in_job import (
    check_eval_prompts,
    evaluated_at,
    final_evaluation_or_error,
    finish_watcher,
    start_watcher,
)
from dflash_ddp.files import SaveError, atomic_write_text
from dflash_ddp.observe.trackers import Trackers, close_trackers, resolve_report_to
from dflash_ddp.parallel.channel import ChannelError, PeerLost
from dflash_ddp.parallel.exits import fail, lost_peer, refuse
from dflash_ddp.parallel.run_lock import OutputDirLock
from dflash_ddp.parallel.signals import interrupt_on_sigterm, interrupt_on_stop
from dflash_ddp.parallel.topology import DistributedContext, Topology, env_world, init_distributed, shutdown
from dflash_ddp.roles.colocated import run_colocated
from dflash_ddp.roles.drafter import run_drafter
from dflash_ddp.roles.step_zero import run_step_zero
from dflash_ddp.roles.target import run_target
from dflash_ddp.setup.calibrate_job import calibrate_split
from dflash_ddp.setup.plan import check_memory
from dflash_ddp.setup.run import Run, build_schedule, load_data, prepare, print_plan, run_identity
from dflash_ddp.setup.start import check_same_data, decide_start, prune_metrics, share_start

ROLES = {"colocated": run_colocated, "target": run_target, "drafter": run_drafter}


def start_trackers(cfg: TrainConfig, start_step: int) -> Trackers | None:
    """--report_to: the experiment trackers, started (with the config) before any training step."""
    names = resolve_report_to(cfg.report_to)
    if not names:
        return None
    trackers = Trackers.start(names, cfg.run_name, cfg.output_dir, config_to_dict(cfg), start_step)
    print(f"reporting metrics to {', '.join(names)} (under {cfg.output_dir})")
    return trackers


def _end_start_up(lock: OutputDirLock | None, release: bool) -> None:
    """SIGTERM back to its default (the roles install their own; a refusal's last lines are not cut by one),
    and on a refusal the output directory's lock released."""
    if lock:
        interrupt_on_sigterm(False)
        if release:
            lock.release()


def finished(run: Run) -> bool:
    """Whether the run resumed at its last step (a fresh run of --max_steps 0 still saves its step 0)."""
    return run.resume_from is not None and run.start_step >= run.schedule.total_steps


def main(argv: list[str] | None = None) -> int:
    """CLI: 0 on success (or a clean stop), 2 on bad input or a refused resume, 1 when a peer or the disk fails."""
    argv = sys.argv[1:] if argv is None else argv
    # a line at a time, as the progress on stderr is: under nohup or `> log` the start-up lines would come last
    if hasattr(sys.stdout, "reconfigure"):  # a real stream (a test may stand another in)
        sys.stdout.reconfigure(line_buffering=True)
    rank, world, local_rank = env_world()
    if "--help" in argv or "-h" in argv:
        if local_rank == 0:  # once per node under torchrun
            print(usage(argv))
        return 0
    where = "" if world == 1 else f" (rank {rank})"
    lock = None  # the output directory's, held by the drafter leader
    try:
        cfg, embedded = parse_config(argv)
        topology = Topology(world, rank, cfg.drafter_ranks, cfg.target_tp_size)
        leader = topology.is_leader
        if embedded and leader:
            data = " ".join(cfg.data)
            print(
                f"training the embedded default: the tiny target {cfg.target_model} with its preset, on {data}"
            )
        # only the drafter leader plans and measures, unless a tensor-parallel group must time its forward
        group_calibration = cfg.calibrate and topology.tp_size > 1
        if cfg.plan and not leader and not group_calibration:
            return 0
        if leader and not cfg.plan:
            # the lock before anything in the directory is read or changed (two jobs would both resume the
            # same checkpoint, and race on rotation, `latest` and metrics.jsonl), and before the target loads
            # and the data is tokenized: a second job on the directory is refused in seconds, not after them
            lock = OutputDirLock(cfg.output_dir)
            for note in lock.acquire():
                print(note)
            # torchrun ends the job's other processes with SIGTERM when one fails: the directory this lock
            # made must not outlive a start-up that a peer refused (the peer's line says why)
            interrupt_on_sigterm(True)
        setup = prepare(cfg, topology)
        if setup.warm_start and leader:
            print("\n".join(setup.warm_start.lines()))
        if setup.notes and leader:
            print("\n".join(setup.notes))
        if cfg.plan:
            if leader:
                print_plan(cfg, setup, topology)
            if cfg.calibrate:
                calibrate_split(cfg, setup, topology, where)
            return 0
        check_memory(cfg, setup.memory)
        if leader and cfg.eval_data:  # the leader evaluates: its prompts are read now, not after training
            check_eval_prompts(cfg, setup.tokenizer)
        data, stats = load_data(cfg, setup, where)
        schedule = build_schedule(cfg, data, topology)
        run = Run(cfg, setup, data, schedule, run_identity(cfg, setup, data, stats, topology))
        ctx = init_distributed(
            cfg.drafter_ranks, cfg.device, cfg.dist_timeout, cfg.channel_backend, cfg.target_tp_size
        )
    except ValueError as e:
        _end_start_up(lock, release=True)
        return refuse(f"error{where}: {e}", first=local_rank == 0, split=world > 1)
    except KeyboardInterrupt as e:  # Ctrl-C while the target downloads, loads or the data is tokenized
        _end_start_up(lock, release=True)
        if str(e) == "SIGTERM" and world > 1:  # torchrun ending the job: a peer said why
            return 143
        print(
            f"interrupted{where}: stopped before training started; the same command starts again",
            file=sys.stderr,
        )
        return 130
    except BaseException:
        _end_start_up(lock, release=True)
        raise
    _end_start_up(lock, release=False)
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
                for note in remove_leftovers(cfg.output_dir) + decide_start(run, topology):
                    print(note)
                if not finished(run):  # run.cfg: the start may have changed the accumulation
                    run.trackers = start_trackers(run.cfg, run.start_step)
            # any failure (a hand-edited trainer_state.json can raise anything) is a refusal on every rank:
            # a leader dying here would leave the others waiting in the broadcast below
            except Exception as e:
                error = str(e) if isinstance(e, ValueError) else f"cannot resume: {type(e).__name__}: {e}"
        share_start(ctx, run, error)
        cfg = run.cfg
    except ValueError as e:  # the same on every rank, decided by the leader: the leader says it
        shutdown()
        return refuse(f"error{where}: {e}", first=leader, split=not topology.colocated, lock=lock)
    if finished(run):  # resumed at the last step: nothing left to train
        shutdown()
        if leader:
            print(
                f"already finished at step {run.start_step} (checkpoint {run.resume_from}); to train further, "
                "raise --max_steps or --num_epochs"
                + (" and name it in --resume_override" if run.start_step else "")
            )
            if cfg.eval_data and not evaluated_at(Path(cfg.output_dir), run.start_step):
                # the job that trained it stopped before evaluating
                interrupt_on_stop()
                _, error = final_evaluation_or_error(cfg, ctx.device)
                if error:
                    print(f"error: {error}", file=sys.stderr)
                    return 2
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
        # replaced, not written through: a link planted in the run directory is not followed elsewhere
        atomic_write_text(out / "data_stats.json", json.dumps(asdict(stats), indent=2) + "\n")
        atomic_write_text(out / "config.json", json.dumps(config_to_dict(run.cfg), indent=2) + "\n")
        print(
            f"data: {stats.summary()}; "
            f"{run.schedule.total_steps} steps of {run.schedule.batches_per_step} batches"
        )
        for note in stats.notes():
            print(note)
        print(f"drafter execution: {run.setup.memory.execution.describe()}")
    start, split = time.perf_counter(), not topology.colocated
    steps = run.schedule.total_steps  # 0: the starting drafter is saved and evaluated, nothing trained
    watcher = start_watcher(cfg, ctx.device) if leader and cfg.eval_steps and steps else None
    trained = False
    try:
        stopped = (ROLES[topology.role] if steps else run_step_zero)(ctx, run)
        trained = True
    except RestoreError as e:
        return fail(f"error{where}: {e}", 2, split, lock=lock)
    except PeerLost as e:  # another rank failed first and says why
        return fail(f"error{where}: {e}", 1, split, consequence=True, lock=lock)
    # a full disk, bad numbers, a rank that never came, a target its rank cannot load or run: no traceback
    except (ChannelError, SaveError, FloatingPointError, TimeoutError, ValueError) as e:
        return fail(f"error{where}: {e}", 1, split, lock=lock)
    except KeyboardInterrupt:  # Ctrl-C before the stop handlers are installed (start-up), or a second one
        return fail(
            f"interrupted{where}: stopped at once; the checkpoints saved before are kept, and the same command "
            "resumes from the last",
            130,
            split,
            lock=lock,
        )
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
            kept = {run.resume_from.name} if run.resume_from else set()
            if removed := rotate_checkpoints(cfg.output_dir, cfg.save_total_limit, kept):
                print(f"after the last evaluation{removal_note(removed, cfg.save_total_limit)}")
        interrupt_on_stop()  # no step to finish now: Ctrl-C ends the evaluation at once
        report, error = (
            final_evaluation_or_error(cfg, ctx.device) if cfg.eval_data and not stopped else (None, "")
        )
        if run.trackers:
            close_trackers(run.trackers, Path(cfg.output_dir), report)
        if error:
            print(f"error: {error}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
