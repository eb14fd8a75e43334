"""Predicted peak memory of a target rank: its share of the weights it runs plus one forward's activations at
`--tokens_per_batch`, the features in flight and, with soft targets, the LM head's logits chunk.
"""

from __future__ import annotations

from dflash_ddp.parallel.machine import MemoryPlan
from dflash_ddp.target_model.info import TargetInfo

SOFT_TARGET_CHUNK = 1024  # positions whose full-vocabulary logits exist at once when taking the top-k


def target_memory(  # noqa: PLR0913 - the sizes the memory formula reads, each one named
    info: TargetInfo,
    num_params: int,
    target_layer_ids: list[int],
    tokens_per_batch: int,
    dtype_bytes: int,
    inflight: int,
    tp_size: int = 1,
    topk: int = 0,
    prefill: tuple[int, int, int] = (0, 0, 0),
) -> MemoryPlan:
    """Predicted peak of a target rank: its share of the weights it runs (`num_params` over the `tp_size`
    ranks of its tensor-parallel group), one forward's activations, features in flight; with `topk` soft
    targets also the whole LM head on every rank, one chunk's fp32 logits and the top-k in flight.
    `prefill` = (--target_prefill_tokens, --max_seq_len, layers run): in pieces, one piece's activations
    of every sequence in the batch, and the KV cache of the whole batch."""
    width = len(target_layer_ids) * info.hidden_size
    q = info.num_attention_heads * info.head_dim
    # a layer's live tensors during a no-grad forward: residual, normed input and the all-reduced output
    # whole on every rank; q/k/v, attention output, gate, up and their product split across the group
    per_token = 4 * info.hidden_size + (2 * q + 3 * info.intermediate_size) // tp_size
    piece, max_seq_len, layers = prefill
    running = tokens_per_batch
    if piece and piece < max_seq_len:  # rows of a batch (at most one per max_seq_len tokens) x one piece
        running = min(tokens_per_batch, max(1, tokens_per_batch // max_seq_len) * piece)
    parts = {
        "weights": num_params * dtype_bytes // tp_size,
        "activations": running * per_token * dtype_bytes,
        "tapped features": 3 * tokens_per_batch * width * dtype_bytes,  # taps, their concat, masked copy
        "sends in flight": inflight * tokens_per_batch * width * dtype_bytes,
    }
    if running < tokens_per_batch:  # the pieces' keys and values, kept until the batch's last piece
        parts["KV cache"] = (
            2 * tokens_per_batch * layers * info.num_key_value_heads * info.head_dim * dtype_bytes // tp_size
        )
    if topk:
        parts["LM head"] = info.vocab_size * info.hidden_size * dtype_bytes
        # a chunk's logits, their softmax and the top-k's work space in fp32
        parts["soft-target logits"] = 3 * min(tokens_per_batch, SOFT_TARGET_CHUNK) * info.vocab_size * 4
        parts["soft targets"] = (2 + inflight) * tokens_per_batch * topk * 6  # the top-k, masked, in flight
    return MemoryPlan(parts)
