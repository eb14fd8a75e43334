"""FLOP counts of the drafter's training step and of the truncated target's forward, and the dense bf16
peaks of common GPUs: what model FLOP utilisation (MFU) is computed from. The formulas are in the docstrings
of `drafter_flops` and `target_forward_flops` and in docs/benchmarks.md; tests/test_bench_gpu_shapes.py checks them
against torch's FLOP counter.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from dflash_ddp.data.batch import Batch
from dflash_ddp.drafter.blocks import plan_draft_chunks
from dflash_ddp.drafter.config import DFlashDraftConfig
from dflash_ddp.drafter.trainer import StepSettings, batch_anchors

# Dense (no sparsity) bf16 tensor-core peaks from NVIDIA's data sheets, TFLOP/s; the first name contained in
# torch.cuda.get_device_name() wins. `--peak_tflops` overrides (and is the only source on other devices).
PEAK_BF16_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H200", 989.0),
    ("H100", 989.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("L40S", 362.0),
)


def matmul_params_per_layer(hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int):
    """Weights of one Qwen3-style layer's matmuls: (q_proj + o_proj, k_proj + v_proj, the MLP's three)."""
    return 2 * hidden * heads * head_dim, 2 * hidden * kv_heads * head_dim, 3 * hidden * intermediate


@dataclass(frozen=True)
class DraftWork:
    """What one drafter step computes on, counted from its anchors (padding blocks left out)."""

    positions: int = 0  # draft positions: blocks x block size
    context_tokens: int = 0  # context tokens fc and every layer's k/v projections run on (per chunk piece)
    scored: int = 0  # positions with a positive loss weight: the LM head's rows
    allowed: int = 0  # (query, key) pairs the block rule allows, per head

    def __add__(self, other: DraftWork) -> DraftWork:
        return DraftWork(*(a + b for a, b in zip(asdict(self).values(), asdict(other).values(), strict=True)))


def draft_work(batch: Batch, settings: StepSettings, block_size: int, epoch: int) -> DraftWork:
    """The work of `DrafterTrainer.step` on `batch`: the same anchors (a pure function of seed, epoch and
    sample id) and the same chunks. A block anchored at a sees the context keys j < a and its own block."""
    lengths = batch.attention_mask.sum(dim=1).tolist()
    anchors = batch_anchors(batch, settings, epoch)
    work = DraftWork()
    for b, a in enumerate(anchors):
        targets = a[:, None] + torch.arange(1, block_size)  # the positions block k = 1..bs-1 predicts
        inside = targets < lengths[b]
        response = batch.loss_mask[b, targets.clamp(max=lengths[b] - 1)].bool()
        work += DraftWork(
            a.numel() * block_size,
            0,
            int((inside & response).sum()),
            block_size * int((a + block_size).sum()),
        )
    chunks = plan_draft_chunks(anchors, lengths, block_size, settings.chunk_tokens)
    context = sum(len(pieces) * max(lengths[row] for row, _ in pieces) for pieces in chunks)
    return work + DraftWork(context_tokens=context)


@dataclass
class FlopCount:
    """FLOPs of one drafter step. `forward`: the forward's matmuls by part; `model`: forward + backward
    without any recomputation (what MFU counts); `executed`: `model` plus what this code recomputes."""

    forward: dict[str, int]
    model: int
    executed: int
    recomputed: dict[str, int] = field(default_factory=dict)

    @property
    def executed_attention(self) -> int:
        """The attention part of `executed` (the rest is matmuls with weights)."""
        again = self.recomputed.get("attention_scores", 0) + self.recomputed.get("layer_attention", 0)
        return 3 * self.forward["attention"] + again


def drafter_flops(
    c: DFlashDraftConfig, work: DraftWork, checkpointing: bool = False, recompute: bool = True
) -> FlopCount:
    """FLOPs of a drafter step (2 per multiply-add), L layers, H hidden, V vocabulary, D head_dim, h heads:

        forward   layers     2 L P (q + k + v + o + 3 H I weights)        P draft positions
                  context    2 L C (k + v weights)                         C context tokens (per chunk piece)
                  fc         2 C (K H) H                                   K tapped layers
                  attention  4 L h D E                                     E allowed (query, key) pairs
                  LM head    2 H V N                                       N scored positions
        model     3 x (layers + context + attention) + 2 x fc + 2 x LM head

    Backward is twice the forward where both the input and the weights get gradients; fc's input (the
    target's features) and the frozen LM head's weight get none, so those two count forward + one
    gradient. Attention counts only the entries the block rule allows (context keys before each anchor
    and the block itself), not the masked-out ones a kernel's tiles may still compute.
    Recomputed by this code, counted in `executed` only: q/k/v projections and the MLP's gate and up
    (drafter/model.py rebuilds them in backward with `recompute`, --recompute qkv_mlp), the attention
    scores (flash-style backward: 2 L h D E), and with gradient checkpointing each layer's forward once
    more. The LM head's logits are not recomputed: the loss takes their gradient in the same pass
    (drafter/objective.py), so the LM head executes its model count, 2 x 2 H V N."""
    L, H, V = c.num_hidden_layers, c.hidden_size, c.vocab_size
    qo, kv, mlp = matmul_params_per_layer(
        H, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    )
    q = qo // 2
    forward = {
        "layers": 2 * L * work.positions * (qo + kv + mlp),
        "context_kv": 2 * L * work.context_tokens * kv,
        "fc": 2 * work.context_tokens * len(c.target_layer_ids) * H * H,
        "attention": 4 * L * c.num_attention_heads * c.head_dim * work.allowed,
        "lm_head": 2 * H * V * work.scored,
    }
    model = 3 * (forward["layers"] + forward["context_kv"] + forward["attention"])
    model += 2 * (forward["fc"] + forward["lm_head"])
    recomputed = {"attention_scores": forward["attention"] // 2}
    if recompute:
        recomputed["qkv"] = 2 * L * (work.positions * (q + kv) + work.context_tokens * kv)
        recomputed["mlp_gate_up"] = 2 * L * work.positions * 2 * H * c.intermediate_size
    if checkpointing:  # the whole layer forward once more
        recomputed["layers"] = forward["layers"] + forward["context_kv"]
        recomputed["layer_attention"] = forward["attention"]
    return FlopCount(forward, model, model + sum(recomputed.values()), recomputed)


def target_forward_flops(config, lengths: list[int]) -> int:
    """FLOPs of one truncated target forward (`config.num_hidden_layers` layers) over sequences of `lengths`:
    2 x the layers' matmul weights x tokens + causal attention, 4 h D per (query, key) pair with key <= query
    (S (S + 1) / 2 pairs per sequence and layer). The embedding is a lookup; norms, rope and SwiGLU's
    elementwise work are left out."""
    weights = sum(
        matmul_params_per_layer(
            config.hidden_size,
            config.intermediate_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
    )
    pairs = sum(s * (s + 1) // 2 for s in lengths)
    heads = config.num_attention_heads * config.head_dim
    return config.num_hidden_layers * (2 * weights * sum(lengths) + 4 * heads * pairs)


def device_peak(device: torch.device, override: float | None) -> tuple[float | None, str]:
    """(dense bf16 peak in FLOP/s, where it came from); (None, why) when unknown."""
    if override:
        return override * 1e12, "--peak_tflops"
    if device.type != "cuda":
        return None, "no peak for a CPU: pass --peak_tflops"
    name = torch.cuda.get_device_name(device)
    for key, tflops in PEAK_BF16_TFLOPS:
        if key in name:
            return tflops * 1e12, f"the table in bench/flops.py ({key})"
    return None, f"{name} is not in the table of bench/flops.py: pass --peak_tflops"
