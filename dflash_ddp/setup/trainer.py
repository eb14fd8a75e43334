"""The drafter's trainer as the run's config sets it up: the one mapping from `TrainConfig` to the step's
and the optimizer's settings, used by the drafter ranks, the calibration and the benchmarks alike.
"""

from __future__ import annotations

import torch

from dflash_ddp.config import TrainConfig
from dflash_ddp.drafter.config import resolve_attention
from dflash_ddp.drafter.model import DFlashDraftModel
from dflash_ddp.drafter.trainer import DrafterTrainer, OptimizerSettings, StepSettings, build_drafter
from dflash_ddp.drafter.weighting import LossSettings
from dflash_ddp.parallel.devices import compute_dtype
from dflash_ddp.setup.plan import Execution
from dflash_ddp.setup.run import RunSetup
from dflash_ddp.setup.warm_start import load_warm_start
from dflash_ddp.target_model.head import SharedTargetHead


def build_trainer(
    cfg: TrainConfig, setup: RunSetup, device: torch.device, total_steps: int, group=None
) -> DrafterTrainer:
    """A freshly initialised drafter with the target's shared head, the optimizer and the schedule."""
    head = SharedTargetHead.from_target(setup.info).to(device=device, dtype=compute_dtype(device))
    drafter = build_drafter(setup.drafter_config, cfg.seed, device)
    if setup.warm_start:  # --init_from (a resumed run's checkpoint then replaces these weights)
        load_warm_start(drafter, setup.warm_start)
    configure_execution(drafter, setup.memory.execution, device)
    settings = step_settings(cfg, resolve_attention(cfg.attention, device), setup.memory.execution.loss_rows)
    return DrafterTrainer(drafter, head, settings, optimizer_settings(cfg, total_steps), group)


def configure_execution(drafter: DFlashDraftModel, execution: Execution, device: torch.device) -> None:
    """Set the drafter up to run as the plan chose: what it recomputes in backward and, keeping every
    activation on CUDA, its layers' elementwise chains compiled into fused kernels."""
    drafter.gradient_checkpointing = execution.checkpointing
    drafter.set_recompute(execution.recompute)
    if device.type == "cuda" and not execution.recompute:
        drafter.compile_regions()


def step_settings(cfg: TrainConfig, attention: str, loss_rows: int) -> StepSettings:
    """What a drafter step reads of the run's config (`attention`: the resolved kernel; `loss_rows`: the
    execution's rows of a loss piece)."""
    loss = LossSettings(
        weighting=cfg.position_weighting,
        gamma=cfg.loss_gamma,
        dpace_smoothing=cfg.dpace_smoothing,
        loss=cfg.loss,
        ce_weight=cfg.ce_weight,
        chunk_rows=loss_rows,
        selector_weight=cfg.selector_loss_alpha,
        soft_targets=cfg.target_topk > 0,
        dspark_ce_alpha=cfg.dspark_ce_alpha,
        dspark_l1_alpha=cfg.dspark_l1_alpha,
        confidence_alpha=cfg.confidence_alpha,
        lilicorr_ce_weight=cfg.lilicorr_ce_alpha,
        lilicorr_margin_weight=cfg.lilicorr_margin_alpha,
        lilicorr_margin=cfg.lilicorr_margin,
        lilicorr_penalty_weight=cfg.lilicorr_penalty_alpha,
    )
    return StepSettings(
        cfg.num_anchors,
        cfg.seed,
        cfg.max_grad_norm,
        attention,
        cfg.drafter_chunk_tokens,
        loss,
        loss_gamma_start=cfg.loss_gamma_start,
        anchor_rule=cfg.anchor_rule,
        anchor_scale_tokens=cfg.anchor_scale_tokens,
    )


def optimizer_settings(cfg: TrainConfig, total_steps: int) -> OptimizerSettings:
    """The optimizer and schedule of the run's config over `total_steps`."""
    return OptimizerSettings(
        cfg.learning_rate,
        cfg.weight_decay,
        cfg.warmup_ratio,
        total_steps,
        cfg.optimizer,
        cfg.muon_orthogonalisation,
    )
