"""The batch type every part of the pipeline passes on: padded token ids, the assistant-only loss mask and
the ids of the samples it holds (what the target runs, the channel carries and the drafter trains on).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Batch:
    """A right-padded batch of samples, as the target and the drafter consume it."""

    input_ids: torch.Tensor  # [B, S]
    attention_mask: torch.Tensor  # [B, S] 1 = real token
    loss_mask: torch.Tensor  # [B, S] 1 = assistant token
    sample_ids: torch.Tensor  # [B]

    @property
    def num_tokens(self) -> int:
        return int(self.attention_mask.sum())
