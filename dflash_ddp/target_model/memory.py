"""Predicted peak memory of a target rank: its share of the truncated weights plus one forward's
activations at `--tokens_per_batch` and the features in flight.
"""

from __future__ import annotations

from dflash_ddp.parallel.machine import MemoryPlan
from dflash_ddp.target_model.info import TargetInfo


def target_memory(
    info: TargetInfo,
    num_params: int,
    target_layer_ids: list[int],
    tokens_per_batch: int,
    dtype_bytes: int,
    inflight: int,
    tp_size: int = 1,
) -> MemoryPlan:
    """Predicted peak of a target rank: its share of the truncated weights (`num_params` over the
    `tp_size` ranks of its tensor-parallel group), one forward's activations, features in flight."""
    width = len(target_layer_ids) * info.hidden_size
    q = info.num_attention_heads * info.head_dim
    # a layer's live tensors during a no-grad forward: residual, normed input and the all-reduced output
    # whole on every rank; q/k/v, attention output, gate, up and their product split across the group
    per_token = 4 * info.hidden_size + (2 * q + 3 * info.intermediate_size) // tp_size
    return MemoryPlan(
        {
            "weights": num_params * dtype_bytes // tp_size,
            "activations": tokens_per_batch * per_token * dtype_bytes,
            "tapped features": 3 * tokens_per_batch * width * dtype_bytes,  # taps, their concat, masked copy
            "sends in flight": inflight * tokens_per_batch * width * dtype_bytes,
        }
    )
