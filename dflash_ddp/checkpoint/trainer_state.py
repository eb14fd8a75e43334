"""trainer_state.json: the run's identity, the data cursor and the topology at a save, what a resume reads
back (every field required), and restoring a trainer from a checkpoint.
"""

from __future__ import annotations

from pathlib import Path

from dflash_ddp.checkpoint.parts import StatefulPart, model_parts, restore_parts
from dflash_ddp.checkpoint.reader import read_json
from dflash_ddp.checkpoint.resume import RestoreError, restore_rng
from dflash_ddp.drafter.trainer import DrafterTrainer
from dflash_ddp.files import describe_error
from dflash_ddp.parallel.topology import Topology

REQUIRED_STATE = (
    "global_step",
    "epoch",
    "batches_consumed",
    "tokens_seen",
    "topology",
    "config",
    "fingerprints",
    "drafter",
)


def trainer_state(identity: dict, topo: Topology, cursor: dict, total_steps: int) -> dict:
    """trainer_state.json of a checkpoint: the run's `identity` (fingerprints, drafter config, settings),
    the data `cursor` (global_step, epoch, batches_consumed, tokens_seen) and the topology."""
    return (
        identity
        | cursor
        | {
            "total_steps": total_steps,  # how an evaluation watcher knows the run's end
            "topology": {
                "world_size": topo.world_size,
                "target_ranks": topo.num_targets,
                "target_tp_size": topo.tp_size,
                "drafter_ranks": topo.num_drafters,
                "colocated": topo.colocated,
            },
        }
    )


def load_trainer_state(path: Path) -> dict:
    """trainer_state.json with every required field present (a missing field is an error, never a default)."""
    state = read_json(path, "trainer_state.json")
    missing = [k for k in REQUIRED_STATE if k not in state]
    missing += [
        f"fingerprints.{k}" for k in ("target", "tokenizer", "data") if k not in state.get("fingerprints", {})
    ]
    missing += [
        f"topology.{k}" for k in ("target_ranks", "drafter_ranks") if k not in state.get("topology", {})
    ]
    if missing:
        raise ValueError(f"{path}/trainer_state.json: missing field(s) {missing}")
    return state


def trainer_parts(trainer: DrafterTrainer) -> list[StatefulPart]:
    """The registered checkpoint parts of a trainer (parts.py)."""
    return model_parts(trainer.drafter, trainer.optimizer, trainer.scheduler)


def restore_training(
    path: Path,
    trainer: DrafterTrainer,
    drafter_index: int,
    start_step: int,
    parts: list[StatefulPart] | None = None,
) -> int:
    """Give every registered part (`parts`, default the trainer's) and the RNG their state from checkpoint
    `path`; returns the tokens seen. The rank's RNG file is chosen by its index among the drafter ranks, not its global rank: a resume
    with another number of target ranks moves the drafters' global ranks. Any failure is a RestoreError.

    The loaded states carry the checkpoint's learning rate and weight decay; the trainer's own settings
    win (they differ only when the user accepted the change with --resume_override)."""
    try:
        restore_parts(path, trainer_parts(trainer) if parts is None else parts)
        restore_rng(path, drafter_index)
        tokens_seen = int(load_trainer_state(path)["tokens_seen"])
    except (ValueError, KeyError, TypeError, RuntimeError) as e:  # a state that does not fit the objects
        raise RestoreError(f"cannot resume from {path}: {describe_error(e, with_type=False)}") from None
    optim, scheduler = trainer.optim, trainer.scheduler
    scheduler.base_lrs = [optim.learning_rate for _ in scheduler.base_lrs]
    for group, schedule_fn in zip(trainer.optimizer.param_groups, scheduler.lr_lambdas, strict=True):
        group.update(initial_lr=optim.learning_rate, weight_decay=optim.weight_decay)
        group["lr"] = optim.learning_rate * schedule_fn(scheduler.last_epoch)
    # what the next step logs as its rate (get_last_lr): the loaded one is the old schedule's after an override
    scheduler._last_lr = [group["lr"] for group in trainer.optimizer.param_groups]
    trainer.global_step = start_step
    return tokens_seen
