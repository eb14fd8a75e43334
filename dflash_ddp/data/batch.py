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


@dataclass
class SoftTargets:
    """The target's top-k next-token distribution at every position of a padded batch (--target_topk): at
    position t, the k most probable tokens at t + 1 and their probabilities; zeros at padding."""

    ids: torch.Tensor  # [B, S, k] int32
    probs: torch.Tensor  # [B, S, k] bfloat16: what the channel carries, so colocated runs see the same values

    @property
    def k(self) -> int:
        return self.ids.shape[-1]


def padding_id(tokenizer) -> int:
    """The token id batches are padded with: the tokenizer's pad token, or 0 when it has none (padding is
    masked out of attention and the loss, so any id will do)."""
    return tokenizer.pad_token_id or 0
