"""The drafter's settings decided from the target before anything trains: tapped layers, mask token,
the drafter's shape, and the attention path for the device.
"""

from __future__ import annotations

import torch

from dflash_ddp.drafter.model import DFlashDraftConfig
from dflash_ddp.target_model.info import TargetInfo, default_target_layer_ids


def resolve_attention(requested: str, device: torch.device) -> str:
    """--attention auto: the compiled flex kernel on CUDA, the block-sparse path elsewhere."""
    if requested != "auto":
        return requested
    return "flex" if device.type == "cuda" else "sparse"


def resolve_mask_token_id(tokenizer, info: TargetInfo, requested: int | None) -> int:
    """The mask token: --mask_token_id, else the tokenizer's mask token; it must have an embedding row."""
    mask_id = requested if requested is not None else getattr(tokenizer, "mask_token_id", None)
    if mask_id is None:
        raise ValueError(
            f"the tokenizer of {info.path} defines no mask token: pass --mask_token_id with an id whose "
            f"embedding row exists (an unused/reserved token, < vocab size {info.vocab_size})"
        )
    if not 0 <= mask_id < info.vocab_size:
        raise ValueError(
            f"--mask_token_id {mask_id} is outside the target's embedding (vocab size {info.vocab_size})"
        )
    return mask_id


def resolve_target_layer_ids(info: TargetInfo, requested: list[int] | None) -> list[int]:
    """--target_layer_ids, else the paper's default; every id must name a decoder layer of the target."""
    ids = list(requested) if requested is not None else default_target_layer_ids(info.num_layers)
    bad = [i for i in ids if not 0 <= i < info.num_layers]
    if bad:
        raise ValueError(
            f"--target_layer_ids {ids}: {bad} out of range; the target has {info.num_layers} layers (0..{info.num_layers - 1})"
        )
    if sorted(set(ids)) != ids:
        raise ValueError(f"--target_layer_ids {ids}: give distinct ids in increasing order")
    return ids


def drafter_config_for(
    info: TargetInfo, num_layers: int, target_layer_ids: list[int], mask_token_id: int, block_size: int
) -> DFlashDraftConfig:
    """A drafter as wide as the target (hidden, MLP, heads, head_dim) with DFlash's own depth and settings."""
    return DFlashDraftConfig(
        vocab_size=info.vocab_size,
        hidden_size=info.hidden_size,
        intermediate_size=info.intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=info.num_attention_heads,
        num_key_value_heads=info.num_key_value_heads,
        head_dim=info.head_dim,
        rms_norm_eps=info.rms_norm_eps,
        max_position_embeddings=info.max_position_embeddings,
        rope_parameters=info.rope_parameters,
        num_target_layers=info.num_layers,
        target_layer_ids=target_layer_ids,
        mask_token_id=mask_token_id,
        block_size=block_size,
    )
