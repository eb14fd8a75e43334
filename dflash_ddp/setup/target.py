"""The target's feature extractor as the run's config sets it up: the one mapping from `TrainConfig` to it,
used by the target ranks, the colocated loop, the calibration and the benchmarks alike.
"""

from __future__ import annotations

import torch

from dflash_ddp.config import TrainConfig
from dflash_ddp.parallel.devices import compute_dtype
from dflash_ddp.setup.run import RunSetup
from dflash_ddp.target_model.features import TargetFeatureExtractor


def build_extractor(
    cfg: TrainConfig, setup: RunSetup, device: torch.device, meshes=None
) -> TargetFeatureExtractor:
    """The frozen target on `device` (this rank's shard of a tensor-parallel group with `meshes`), returning
    the drafter's tapped features and, with --target_topk, soft targets, prefilled as --target_prefill_tokens
    says."""
    return TargetFeatureExtractor(
        setup.info,
        setup.drafter_config.target_layer_ids,
        device,
        compute_dtype(device),
        meshes,
        cfg.target_topk,
        cfg.target_prefill_tokens,
    )
