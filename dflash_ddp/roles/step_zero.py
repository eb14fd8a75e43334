"""Every rank's loop in a run of --max_steps 0: no step, nothing streamed. The drafter ranks build the drafter
the run starts from (--init_from's, or a fresh one of --seed) and the leader saves it as the step-0
checkpoint, with the layout and trainer_state of any checkpoint: the export stamps it, the evaluation measures
it and a resume with more steps trains on from it, as from any other. The target ranks load no target and send
nothing; they end once the checkpoint is on disk.
"""

from __future__ import annotations

from dflash_ddp.checkpoint.trainer_state import trainer_parts, trainer_state
from dflash_ddp.checkpoint.writer import drafter_rng_states, save_checkpoint
from dflash_ddp.parallel.topology import DistributedContext, job_barrier
from dflash_ddp.roles.drafter import data_cursor
from dflash_ddp.setup.run import Run
from dflash_ddp.setup.trainer import build_trainer


def run_step_zero(ctx: DistributedContext, run: Run) -> bool:
    """Save the starting drafter as step 0 (drafter ranks), or wait for it (target ranks); never stopped early."""
    topo = ctx.topology
    if topo.role != "target":
        save_start(ctx, run)
    if not topo.colocated:
        job_barrier("step-zero-saved")  # no rank leaves the job before the checkpoint is written
    return False


def save_start(ctx: DistributedContext, run: Run) -> None:
    """Build the trainer as a training run does before its first step (the same drafter, optimizer, schedule
    and generators, so that a resume from step 0 trains as a fresh run would) and save it as step 0."""
    topo, cfg = ctx.topology, run.cfg
    group = ctx.drafter_group if topo.num_drafters > 1 else None
    trainer = build_trainer(cfg, run.setup, ctx.device, run.schedule.total_steps, group)
    rng_states = drafter_rng_states(group)  # every drafter rank takes part, as at any save
    if topo.is_leader:
        state = trainer_state(run.identity, topo, data_cursor(run, 0, 0, 0), run.schedule.total_steps)
        parts, config = trainer_parts(trainer), trainer.drafter.config
        path = save_checkpoint(cfg.output_dir, 0, parts, config, state, rng_states, cfg.save_total_limit)
        print(f"--max_steps 0: saved the drafter as the run starts it, untrained here, as {path}")
