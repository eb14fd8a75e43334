"""Predicted peak memory of a target rank: its share of the weights it runs plus one forward's activations at
`--tokens_per_batch`, the features in flight and, with soft targets, the LM head's logits chunk.
"""

from __future__ import annotations

from dflash_ddp.parallel.machine import MemoryPlan
from dflash_ddp.target_model.info import TargetInfo

SOFT_TARGET_CHUNK = 1024  # positions whose full-vocabulary logits exist at once when taking the top-k


def target_memory(
    info: TargetInfo,
    num_params: int,
    target_layer_ids: list[int],
    tokens_per_batch: int,
    dtype_bytes: int,
    inflight: int,
    tp_size: int = 1,
    topk: int = 0,
) -> MemoryPlan:
    """Predicted peak of a target rank: its share of the weights it runs (`num_params` over the `tp_size`
    ranks of its tensor-parallel group), one forward's activations, features in flight; with `topk` soft
    targets also the whole LM head on every rank, one chunk's fp32 logits and the top-k in flight."""
    width = len(target_layer_ids) * info.hidden_size
    q = info.num_attention_heads * info.head_dim
    # a layer's live tensors during a no-grad forward: residual, normed input and the all-reduced output
    # whole on every rank; q/k/v, attention output, gate, up and their product split across the group
    per_token = 4 * info.hidden_size + (2 * q + 3 * info.intermediate_size) // tp_size
    parts = {
        "weights": num_params * dtype_bytes // tp_size,
        "activations": tokens_per_batch * per_token * dtype_bytes,
        "tapped features": 3 * tokens_per_batch * width * dtype_bytes,  # taps, their concat, masked copy
        "sends in flight": inflight * tokens_per_batch * width * dtype_bytes,
    }
    if topk:
        parts["LM head"] = info.vocab_size * info.hidden_size * dtype_bytes
        # a chunk's logits, their softmax and the top-k's work space in fp32
        parts["soft-target logits"] = 3 * min(tokens_per_batch, SOFT_TARGET_CHUNK) * info.vocab_size * 4
        parts["soft targets"] = (2 + inflight) * tokens_per_batch * topk * 6  # the top-k, masked, in flight
    return MemoryPlan(parts)
