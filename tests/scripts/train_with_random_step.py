"""`python -m dflash_ddp.train` with a training step that also draws from torch's global CPU generator
(as dropout would): a resumed run then ends like an uninterrupted one only if every drafter rank's
generator state is saved and restored."""

import sys

import torch

from dflash_ddp.drafter import trainer
from dflash_ddp.train import main

original_step = trainer.DrafterTrainer.step


def step_with_noise(self, micro_batches):
    metrics = original_step(self, micro_batches)
    with torch.no_grad():
        for p in self.drafter.parameters():
            p.add_(torch.randn_like(p), alpha=1e-3)
    return metrics


trainer.DrafterTrainer.step = step_with_noise
sys.exit(main())
