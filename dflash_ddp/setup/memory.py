"""Predicted peak memory of a target rank and a drafter rank, and the check that a run fits its machine.

The drafter's peak is set by one chunk of draft positions (`--drafter_chunk_tokens`), not by the batch:
the tensors autograd keeps per draft position and layer are counted from the layer's code (see
`saved_per_position`; a test measures them with saved-tensor hooks), plus the attention and loss
workspaces, the received features, the weights with their gradients and AdamW moments, and the target's
frozen embedding and LM head. The target's peak is its truncated weights plus one forward's activations
at `--tokens_per_batch`. On a CPU the ranks of a node share its RAM, so the check adds them up; on GPUs
each rank has its own device.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from dflash_ddp.drafter.attention import WORKSPACE_BYTES
from dflash_ddp.drafter.config import DFlashDraftConfig
from dflash_ddp.drafter.model import MLP_ROWS
from dflash_ddp.target_model.info import TargetInfo

GIB = 1 << 30


CUDA_RESERVE = 2 * GIB  # CUDA context, allocator caching and fragmentation, outside the tensors counted here


def saved_per_position(c: DFlashDraftConfig) -> int:
    """Elements kept for backward per draft position per drafter layer.

    The layer's input (H; the norm, projections, q/k norms and rope are recomputed from it in backward),
    q, k and v after rope and the attention output, which o_proj reads as a view (2 q-width + 2 kv-width),
    one log-sum-exp per head, and the MLP's input (H; the MLP recomputes itself in backward)."""
    q_width, kv_width = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    return 2 * c.hidden_size + 2 * q_width + 2 * kv_width + c.num_attention_heads


def saved_per_context_token(c: DFlashDraftConfig) -> int:
    """Elements kept per context token per layer: its keys after rope and its values."""
    return 2 * c.num_key_value_heads * c.head_dim


def backward_per_position(c: DFlashDraftConfig) -> int:
    """Elements that exist only during the backward of one layer, per draft position, beside the saved ones:
    the recomputed normed input, q/k/v before and after their norms and rope, and the gradients of the
    residual stream, the attention output, q, k and v (fp32)."""
    q_width, kv_width = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    return 4 * c.hidden_size + 4 * q_width + 6 * kv_width


@dataclass
class MemoryPlan:
    """Bytes by component for one rank; `total` is the predicted peak."""

    parts: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def describe(self) -> str:
        return ", ".join(f"{name} {size / GIB:.2f}" for name, size in self.parts.items() if size) + " GiB"


def drafter_memory(
    c: DFlashDraftConfig,
    num_params: int,
    chunk_tokens: int,
    tokens_per_batch: int,
    max_seq_len: int,
    loss_chunk_size: int,
    attention: str,
    dtype_bytes: int,
    received_batches: int,
    checkpointing: bool = False,
) -> MemoryPlan:
    """Predicted peak of a drafter rank: state, one chunk's activations and workspaces, received features.

    A chunk's tensors peak in one of two moments, whichever holds more: at the loss (every layer's saved
    tensors and the loss's logits chunks) or inside the backward of the last layer (the other layers'
    saved tensors, the last layer's input, and that layer's backward temporaries; its other saved tensors
    are freed by then: measured, the peak sits in the recomputation of its q/k/v). So "activations" counts
    what both moments share and "backward or loss" the larger of the two remainders.

    With per-layer gradient checkpointing the layers keep only their inputs, and one layer's activations
    exist again while its backward recomputes them."""
    width = len(c.target_layer_ids) * c.hidden_size
    positions = chunk_tokens
    context = min(chunk_tokens, tokens_per_batch)  # a chunk's padded context is bounded like its positions
    per_layer = positions * saved_per_position(c) + context * saved_per_context_token(c)
    # once per chunk: the features, fc's output, the block embeddings, the final norm and the loss's copy
    once = context * (width + c.hidden_size) + positions * 3 * c.hidden_size
    last_input = positions * c.hidden_size
    if checkpointing:  # every layer's input, and the last one recomputed in full (not measured: generous)
        shared, last_rest = c.num_hidden_layers * last_input + per_layer, 0
    else:
        shared, last_rest = (c.num_hidden_layers - 1) * per_layer + last_input, per_layer - last_input
    activations = (shared + once) * dtype_bytes
    # backward of one layer, next to the saved tensors; the MLP and the norms work in pieces of rows
    backward = positions * backward_per_position(c) * 4 + 5 * MLP_ROWS * c.intermediate_size * 4
    loss_ws = 2 * min(loss_chunk_size, positions) * c.vocab_size * 4
    if attention == "dense":  # the reference path: a [Q, S + Q] mask and its complement, SDPA's blocks
        # 10 bytes per mask entry on the CPU (measured, torch 2.13); on CUDA the math kernel keeps the
        # scores and their softmax per head
        per_entry = 8 * c.num_attention_heads if dtype_bytes == 2 else 10
        attention_ws = per_entry * positions * (max_seq_len + positions)
    elif attention == "sparse":
        attention_ws = 3 * WORKSPACE_BYTES
    else:  # flex: tiles in on-chip memory; the BlockMask is small
        attention_ws = 0
    return MemoryPlan(
        {
            "weights+grads+AdamW": num_params * 16,
            "target embedding+LM head": 2 * c.vocab_size * c.hidden_size * dtype_bytes,
            "received features": received_batches * tokens_per_batch * width * dtype_bytes,
            "activations": activations,
            "backward or loss": max(backward, last_rest * dtype_bytes + loss_ws),
            "attention workspace": attention_ws,
        }
    )


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


def process_baseline() -> int:
    """This process's resident memory now (the runtime and libraries every rank carries on a CPU)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_resident_bytes() -> int:
    """This process's own peak resident memory (VmHWM of /proc/self/status; ru_maxrss off Linux).

    Not getrusage's ru_maxrss on Linux: a process started by another one (subprocess, pytest) inherits its
    starter's high-water mark through fork and exec, so a small run started from a 1 GiB process reports
    at least 1 GiB (the measured-peak test read 1.11 GiB inside the test suite for a 0.73 GiB run)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:  # pragma: no cover - not Linux
        pass
    import resource  # pragma: no cover

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # pragma: no cover


def available_host_memory() -> int:
    """MemAvailable of this machine, plus what this process already holds."""
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["MemAvailable"].split()[0]) * 1024 + process_baseline()


@dataclass
class FitCheck:
    """What a node must hold and what it has; `fits` decides whether the run may start."""

    needed: int
    available: int
    where: str

    @property
    def fits(self) -> bool:
        return self.needed <= self.available


def check_fit(
    drafter: MemoryPlan, target: MemoryPlan, node_roles: list[str], device: torch.device
) -> FitCheck:
    """Whether the ranks of this node fit: on a CPU all of them in one RAM, each with the runtime's own
    baseline; on GPUs the larger rank against one device's memory. `node_roles`: target, drafter or
    colocated, one per rank of the node."""
    # colocated: the target's forward ends before the drafter's step begins, so only the target's weights
    # and the larger of the two transient parts add up
    state = drafter.parts["weights+grads+AdamW"] + drafter.parts["target embedding+LM head"]
    colocated = target.parts["weights"] + max(drafter.total, target.total - target.parts["weights"] + state)
    sizes = {"target": target.total, "drafter": drafter.total, "colocated": colocated}
    if device.type == "cuda":
        usable, where = device_capacity(device)
        return FitCheck(max(sizes[r] for r in node_roles), usable, where)
    needed = sum(sizes[r] for r in node_roles) + len(node_roles) * process_baseline()
    available = available_host_memory()
    ranks = f"{len(node_roles)} processes in " if len(node_roles) > 1 else ""
    return FitCheck(needed, available, f"{ranks}this machine's RAM ({available / GIB:.1f} GiB available)")


def device_capacity(device: torch.device) -> tuple[int, str]:
    """Bytes one process may use on `device` (a GPU's memory less CUDA_RESERVE, or this machine's available
    RAM) and their description for messages."""
    if device.type == "cuda":
        usable = torch.cuda.get_device_properties(device).total_memory - CUDA_RESERVE
        return usable, f"one {torch.cuda.get_device_name(device)} ({usable / GIB:.1f} GiB usable)"
    available = available_host_memory()
    return available, f"this machine's RAM ({available / GIB:.1f} GiB available)"
