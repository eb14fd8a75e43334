"""`--plan --calibrate` as a job: the ranks time one target rank's (or group's) and one drafter rank's work
on this machine with the run's own first batches, then the leader prints the split that trains fastest
(the figures and the recommendation are calibrate.py's).
"""

from __future__ import annotations

import dataclasses
import json

import torch

from dflash_ddp.config import TrainConfig
from dflash_ddp.data.batch import padding_id
from dflash_ddp.drafter.trainer import DrafterTrainer
from dflash_ddp.parallel.devices import compute_dtype
from dflash_ddp.parallel.topology import Topology, init_distributed, job_barrier, job_store, shutdown
from dflash_ddp.setup.calibrate import (
    RandomFeatures,
    Rates,
    calibration_batches,
    calibration_steps,
    measure_rates,
    report,
    time_target_forward,
)
from dflash_ddp.setup.run import RunSetup, load_data, run_device
from dflash_ddp.setup.target import build_extractor
from dflash_ddp.setup.trainer import build_trainer


def calibrate_split(cfg: TrainConfig, setup: RunSetup, topology: Topology, where: str) -> None:
    """--plan --calibrate, on the drafter leader: time one target rank's and one drafter rank's work on this
    process's device with the first batches of the run's schedule, then print the split that trains fastest.
    A fresh drafter trains a few steps; nothing is restored or saved (the tokenized data cache is kept).
    With tensor-parallel groups the first group times its own forward (calibrate_group_split)."""
    if topology.tp_size > 1:
        calibrate_group_split(cfg, setup, where)
        return
    data, _ = load_data(cfg, setup, where, together=False)
    device = run_device(cfg)
    extractor = build_extractor(cfg, setup, device)
    trainer = build_trainer(cfg, setup, device, calibration_steps(device))
    measurement = measure_rates(
        calibration_schedule(cfg, setup, data, device), extractor, trainer, cfg.gradient_accumulation_steps
    )
    print_calibration(measurement, topology, trainer, device, cfg.gradient_accumulation_steps)


def calibration_schedule(cfg: TrainConfig, setup: RunSetup, data, device: torch.device):
    """The (batch, epoch) pairs a calibration times: the first of the run's own schedule."""
    pad_id = padding_id(setup.tokenizer)
    return calibration_batches(
        data,
        cfg.tokens_per_batch,
        cfg.seed,
        cfg.gradient_accumulation_steps,
        pad_id,
        calibration_steps(device),
    )


def print_calibration(
    measurement, topology: Topology, trainer: DrafterTrainer, device, accumulation: int
) -> None:
    """The calibration's report (calibrate.report) for this launch's topology and accumulation."""
    gradient_bytes = sum(p.numel() * p.element_size() for p in trainer.drafter.parameters())
    for line in report(
        measurement,
        topology.world_size,
        device,
        topology.num_drafters,
        gradient_bytes,
        topology.tp_size,
        accumulation,
    ):
        print(line)


def calibrate_group_split(cfg: TrainConfig, setup: RunSetup, where: str) -> None:
    """--plan --calibrate with --target_tp_size N, on every rank: the ranks of target group 0 load their
    shards and time the group's forward together; then the drafter leader times its steps on random
    features (a group's target does not fit it) and prints the split, a group counting as one target unit."""
    ctx = init_distributed(
        cfg.drafter_ranks, cfg.device, cfg.dist_timeout, cfg.channel_backend, cfg.target_tp_size
    )
    topo, device, store = ctx.topology, ctx.device, job_store()
    try:
        measures_target = topo.role == "target" and topo.group == 0
        data = load_data(cfg, setup, where, together=False)[0] if measures_target or topo.is_leader else None
        if measures_target:
            extractor = build_extractor(cfg, setup, device, ctx.target_meshes)
            timed = time_target_forward(
                calibration_schedule(cfg, setup, data, device), extractor, cfg.gradient_accumulation_steps
            )
            if topo.rank == topo.group_ranks(0)[0]:
                store.set("dflash_ddp/calibrate/group", json.dumps(timed))
        job_barrier("calibrate-target")  # the drafter's timing starts after the group's: no shared cores
        if topo.is_leader:
            sequences, target_s = json.loads(store.get("dflash_ddp/calibrate/group"))
            width = len(setup.drafter_config.target_layer_ids) * setup.info.hidden_size
            features = RandomFeatures(
                width, device, compute_dtype(device), cfg.target_topk, setup.info.vocab_size
            )
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
            print_calibration(measurement, topo, trainer, device, cfg.gradient_accumulation_steps)
        job_barrier("calibrate-done")
    finally:
        shutdown()
