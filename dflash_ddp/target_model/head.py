"""The two tensors the drafter shares with the target (input embedding and LM head), read straight from the
target's safetensors files without building the model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from dflash_ddp.target_model.info import TargetInfo
from dflash_ddp.target_model.text_stack import tensor_locations


def load_shared_embeddings(info: TargetInfo) -> tuple[torch.Tensor, torch.Tensor]:
    """Read ONLY the input embedding and LM head from the target's safetensors (never the whole model): the
    tensors the checkpoint's own `get_input_embeddings()` / `get_output_embeddings()` name (text_stack.py)."""
    stack = info.text_stack()
    locations = tensor_locations(info.path)
    tensors = {}
    for name in dict.fromkeys([stack.embed_tensor, stack.head_tensor]):
        if name not in locations:
            raise ValueError(
                f"--target_model {info.path}: no '{name}' tensor in the safetensors files, where "
                f"{stack.architecture} keeps its {'input embedding' if name == stack.embed_tensor else 'LM head'}"
            )
        with safe_open(locations[name], framework="pt") as f:
            tensors[name] = f.get_tensor(name)
    return tensors[stack.embed_tensor], tensors[stack.head_tensor]


class SharedTargetHead(nn.Module):
    """The target's frozen embedding and LM head, held beside the drafter (not part of its checkpoint).

    `embed` computes as the target's own embedding does: rows times `embedding_scale` (Gemma's sqrt(hidden)
    normaliser, applied in the embedding's dtype as transformers does); the loss soft-caps the head's logits
    at `logit_softcapping` and scales them by `logit_scale` where the target does (LossSettings)."""

    def __init__(
        self,
        embed_weight: torch.Tensor,
        lm_head_weight: torch.Tensor,
        embedding_scale: float = 1.0,
        logit_softcapping: float | None = None,
        logit_scale: float = 1.0,
    ):
        super().__init__()
        self.embed_tokens = nn.Embedding.from_pretrained(embed_weight.float(), freeze=True)
        self.lm_head_weight = nn.Parameter(lm_head_weight.float(), requires_grad=False)
        self.embedding_scale = embedding_scale
        self.logit_softcapping = logit_softcapping  # the target's final logits: cap * tanh(logits / cap)
        self.logit_scale = logit_scale  # ... of the head's logits times this

    @classmethod
    def from_target(cls, info: TargetInfo) -> SharedTargetHead:
        conventions = (info.embedding_scale, info.final_logit_softcapping, info.logit_scale)
        return cls(*load_shared_embeddings(info), *conventions)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The target's input embedding of `ids`."""
        return embed_as_target(self.embed_tokens.weight, ids, self.embedding_scale)


def embed_as_target(weight: torch.Tensor, ids: torch.Tensor, scale: float) -> torch.Tensor:
    """The rows of `ids` in the embedding `weight`, times the target's `scale` in the rows' dtype as
    transformers rounds it (Gemma's sqrt(hidden), Falcon-H1's multiplier)."""
    rows = F.embedding(ids, weight)
    return rows if scale == 1.0 else rows * torch.tensor(scale).to(rows.dtype)

    @property
    def vocab_size(self) -> int:
        return self.embed_tokens.num_embeddings
