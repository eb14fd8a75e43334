"""Predicted peak memory of a drafter rank. The peak is set by one chunk of draft positions
(`--drafter_chunk_tokens`), not by the batch: the tensors autograd keeps per draft position and layer are
counted from the layer's code (see `saved_per_position`; a test measures them with saved-tensor hooks),
plus the attention and loss workspaces, the received features, the weights with their gradients and the
optimizer's state, and the target's frozen embedding and LM head.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash_ddp.drafter.attention import WORKSPACE_BYTES
from dflash_ddp.drafter.config import DFlashDraftConfig
from dflash_ddp.drafter.model import MLP_ROWS
from dflash_ddp.parallel.machine import MemoryPlan


def saved_per_position(c: DFlashDraftConfig, recompute: bool = True) -> int:
    """Elements kept for backward per draft position per drafter layer.

    Recomputing (`--recompute qkv_mlp`): the layer's input (H; the norm, projections, q/k norms and rope are
    recomputed from it in backward), q, k and v after rope and the attention output, which o_proj reads as a
    view (2 q-width + 2 kv-width), one log-sum-exp per head, and the MLP's input (H; the MLP recomputes itself
    in backward); plus what a family's layer keeps beyond that (DFlash2: its convolutions). Keeping
    everything adds `kept_per_position`."""
    q_width, kv_width = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    dflash = 2 * c.hidden_size + 2 * q_width + 2 * kv_width + c.num_attention_heads
    return dflash + c.extra_saved_per_position() + (0 if recompute else kept_per_position(c))


def kept_per_position(c: DFlashDraftConfig) -> int:
    """Elements a layer keeps per draft position when nothing is recomputed (`--recompute none`) beyond the
    recomputing layer's: q and k before their norms and the norms' 1/rms per head, the MLP's gate, up,
    silu(gate) and their product (4 intermediate-wide), and the family's normed inputs."""
    q_width, kv_width = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    heads = c.num_attention_heads + c.num_key_value_heads
    return q_width + kv_width + heads + 4 * c.intermediate_size + c.kept_normed_inputs_per_position()


def saved_per_context_token(c: DFlashDraftConfig, recompute: bool = True) -> int:
    """Elements kept per context token per layer: its keys after rope and its values; keeping everything, its
    keys before their norm and their 1/rms too."""
    kept = 0 if recompute else c.num_key_value_heads * (c.head_dim + 1)
    return 2 * c.num_key_value_heads * c.head_dim + kept


def backward_per_position(c: DFlashDraftConfig, recompute: bool = True) -> int:
    """Elements that exist only during the backward of one layer, per draft position, beside the saved ones.

    Recomputing: the recomputed normed input, q/k/v before and after their norms and rope, and the gradients
    of the residual stream, the attention output, q, k and v (fp32); the MLP's pieces of rows are counted
    apart (MLP_ROWS). Keeping everything: the gradients of the residual stream and the normed input, the
    attention output, q, k and v before and after their norms, and of the MLP's four intermediate-wide
    tensors, with the norms' backward over all rows at once."""
    q_width, kv_width = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    if recompute:
        return 4 * c.hidden_size + 4 * q_width + 6 * kv_width
    return 4 * c.hidden_size + 3 * q_width + 4 * kv_width + 4 * c.intermediate_size


@dataclass(frozen=True)
class DrafterLoad:
    """What a drafter rank holds and works on, besides the drafter's shape: the sizes `drafter_memory` reads."""

    num_params: int
    optimizer_state: int  # bytes of the optimizer's state (`optimizer_state_bytes`)
    chunk_tokens: int  # draft positions of one chunk
    tokens_per_batch: int
    max_seq_len: int
    loss_chunk_size: int
    attention: str  # dense | sparse | flex
    dtype_bytes: int
    received_batches: (
        int  # feature batches held at once (split: up to --max_inflight arrive while one trains)
    )
    checkpointing: bool = False
    recompute: bool = True  # --recompute qkv_mlp (False: none, every activation kept)


def drafter_memory(c: DFlashDraftConfig, load: DrafterLoad) -> MemoryPlan:
    """Predicted peak of a drafter rank: state, one chunk's activations and workspaces, received features.

    A chunk's tensors peak in one of two moments, whichever holds more: at the loss (every layer's saved
    tensors, the loss's logits chunk and the rows' gradient it keeps) or inside the backward of the last
    layer (the other layers' saved tensors, the last layer's input, and that layer's backward temporaries;
    its other saved tensors are freed by then: measured, the peak sits in the recomputation of its q/k/v).
    So "activations" counts what both moments share and "backward or loss" the larger of the two
    remainders.

    With per-layer gradient checkpointing the layers keep only their inputs, and one layer's activations
    exist again while its backward recomputes them."""
    width = len(c.target_layer_ids) * c.hidden_size
    positions, max_seq_len, dtype_bytes = load.chunk_tokens, load.max_seq_len, load.dtype_bytes
    tokens_per_batch, loss_chunk_size = load.tokens_per_batch, load.loss_chunk_size
    # a chunk's padded context is bounded like its positions, except that one sequence longer than a chunk
    # is a chunk of its own with its whole context (long-context runs)
    context = min(max(positions, max_seq_len), tokens_per_batch)
    recompute = load.recompute
    per_layer = positions * saved_per_position(c, recompute) + context * saved_per_context_token(c, recompute)
    # once per chunk: the features, fc's output, the block embeddings, the final norm and the loss's copy
    once = context * (width + c.hidden_size) + positions * 3 * c.hidden_size
    last_input = positions * c.hidden_size
    if (
        load.checkpointing
    ):  # every layer's input, and the last one recomputed in full (not measured: generous)
        shared, last_rest = c.num_hidden_layers * last_input + per_layer, 0
    else:
        shared, last_rest = (c.num_hidden_layers - 1) * per_layer + last_input, per_layer - last_input
    activations = (shared + once) * dtype_bytes
    # backward of one layer, next to the saved tensors; the MLP and the norms work in pieces of rows
    backward = positions * (backward_per_position(c, recompute) + c.extra_backward_per_position()) * 4
    if recompute:
        backward += 5 * MLP_ROWS * c.intermediate_size * 4
    # the loss: a chunk's fp32 logits and their softmax gradient (measured: nothing else that size at once),
    # beside the gradient of its rows, at most one per position (the fused LM-head loss keeps it from its
    # forward to its backward; DSpark's checkpointed loss adds it up over its chunks' backward)
    loss_rows = min(loss_chunk_size, positions)
    loss_ws = 2 * loss_rows * c.vocab_size * 4 + positions * c.hidden_size * dtype_bytes
    loss_ws += c.extra_loss_bytes(loss_rows, positions, dtype_bytes)
    if load.attention == "dense":  # the reference path: a [Q, S + Q] mask and its complement, SDPA's blocks
        # 10 bytes per mask entry on the CPU (measured, torch 2.13); on CUDA the math kernel keeps the
        # scores and their softmax per head
        per_entry = 8 * c.num_attention_heads if dtype_bytes == 2 else 10
        attention_ws = per_entry * positions * (max_seq_len + positions)
    elif load.attention == "sparse":
        attention_ws = 3 * WORKSPACE_BYTES
    else:  # flex: tiles in on-chip memory; the BlockMask is small
        attention_ws = 0
    # lookup tables (DFlash2's codebooks, DSpark's Markov tables): fp32 weights and gradients and AdamW's two
    # moments, shown apart
    tables = c.lookup_table_params() * 16
    state = {
        "weights+grads+optimizer": load.num_params * 8 + load.optimizer_state - tables,
        **({c.lookup_table_label: tables} if tables else {}),
        "target embedding+LM head": 2 * c.vocab_size * c.hidden_size * dtype_bytes,
    }
    return MemoryPlan(
        {
            **state,
            "received features": load.received_batches * tokens_per_batch * width * dtype_bytes,
            "activations": activations,
            "backward or loss": max(backward, last_rest * dtype_bytes + loss_ws),
            "attention workspace": attention_ws,
        },
        lasting=tuple(state),
    )
