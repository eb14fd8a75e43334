"""The DFlash2 drafter (z-lab, 2026): DFlash's backbone with dependence inside the block.

Two pieces are added, both as vLLM (`qwen3_dflash2.py`) and SGLang serve them:

- per decoder layer two grouped dynamic convolutions, `attention_conv` and `mlp_conv`. One projection of the
  normed sublayer input gives per-token, per-group kernel deltas for two sides; side 0 convolves that input
  before the sublayer (attention or MLP), side 1 the sublayer's output after it:
  out[i, c] = sum_{t < taps} (base[side, t, c] + delta[i, side, t, c // group]) * x[i - t, c], where a tap
  reaching before the block's first position gives zero: causal inside a block, never across blocks. The
  block's position 0 is its anchor; the context features are never convolved.
- the candidate selector after the final norm (selector.py), which drafts each position given the one
  before it.

Initialised as DFlash: each convolution is the identity (tap 0 of the base kernel 1, the rest and the
projection 0) and the successor codebook is zero, so an untrained DFlash2 drafter drafts exactly what the
DFlash drafter with the same backbone drafts. With the same seed the backbone is DFlash's, weight for weight:
the added weights draw no random numbers before the backbone's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from dflash_ddp.drafter.attention import attend
from dflash_ddp.drafter.config import DFlashDraftConfig
from dflash_ddp.drafter.model import DFlashDecoderLayer, DFlashDraftModel, dynamic_lengths
from dflash_ddp.drafter.selector import CandidateSelector, selector_terms, walk


class DFlash2DraftConfig(DFlashDraftConfig):
    """Shape of a DFlash2 drafter: a DFlash drafter's, plus its convolutions and candidate selector."""

    model_type = "dflash2_draft"
    family = "dflash2"
    # set by the run's settings of the same names (--conv_kernel_size, ...)
    run_settings = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
    # written into (and read from) the serving config's dflash_config, under these names; training keeps the
    # multiplier at 1 (the target's soft-capping, a field of every family, is the target's own)
    serving_fields = (*run_settings, "output_multiplier")

    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16
    output_multiplier: float = 1.0

    def shape_errors(self) -> list[str]:
        """What makes this shape unservable, each naming the setting to change (empty when it is sound)."""
        errors = super().shape_errors()
        h, bs = self.hidden_size, self.block_size
        if not 1 <= self.conv_kernel_size <= bs:
            errors.append(f"conv_kernel_size {self.conv_kernel_size} must be in [1, block_size {bs}]")
        if self.conv_group_size < 1 or h % self.conv_group_size:
            errors.append(f"conv_group_size {self.conv_group_size} must divide the hidden size {h}")
        if not self.output_multiplier > 0:
            errors.append(
                f"output_multiplier {self.output_multiplier} must be positive (it orders the candidates)"
            )
        if self.selector_rank < 1:
            errors.append(f"selector_rank {self.selector_rank} must be at least 1")
        if not 1 <= self.selector_top_k <= self.vocab_size:
            errors.append(
                f"selector_top_k {self.selector_top_k} must be in [1, vocab size {self.vocab_size}]"
            )
        return errors

    def extra_saved_per_position(self) -> int:
        """Beyond a DFlash layer (which keeps its input and the MLP's): the normed inputs of both sublayers
        (the projections' and the convolutions' input), the convolved inputs (the attention's and the MLP's),
        both sublayer outputs (side 1's input), the post-attention residual, the deltas of both convolutions
        and the two norms' 1/rms; the kernels, shifted copies and the MLP's inner tensors are recomputed."""
        deltas = 2 * 2 * self.conv_kernel_size * (self.hidden_size // self.conv_group_size)
        return 6 * self.hidden_size + deltas + 2

    def kept_normed_inputs_per_position(self) -> int:
        """None: the normed inputs are the convolutions', counted in `extra_saved_per_position`."""
        return 0

    lookup_table_label = "selector codebooks"  # the plan's name for them

    def lookup_table_params(self) -> int:
        """The selector's two codebooks, [V, rank] each."""
        return 2 * self.vocab_size * self.selector_rank

    def extra_loss_bytes(self, rows: int, positions: int, dtype_bytes: int) -> int:
        """The selector's loss per chunk of rows: the gathered LM-head rows of the candidates [rows, K, H],
        in forward and again in backward, and each codebook's dense fp32 gradient [V, rank]."""
        gathered = 2 * rows * self.selector_top_k * self.hidden_size * dtype_bytes
        return gathered + 2 * self.vocab_size * self.selector_rank * 4

    def extra_backward_per_position(self) -> int:
        """The MLP recomputed whole rather than in pieces of rows (gate, up, their product and its gradients:
        about five intermediate-wide tensors), and one convolution's kernels and shifted input recomputed."""
        return 5 * self.intermediate_size + 2 * self.conv_kernel_size * self.hidden_size


class KernelProjection(nn.Linear):
    """A convolution's kernel projection: zero from the start, drawing no random numbers (a Linear's own
    initialisation would move the generator, and every backbone weight drawn after it would differ)."""

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)


# the attention's own input norm is replaced by the convolution after it
_NORMED_ALREADY = nn.Identity()


class DynamicConvolution(nn.Module):
    """A grouped dynamic convolution over the positions of each block (module docstring): `prepare` convolves
    a sublayer's normed input and returns the deltas that `finish` uses on its output."""

    def __init__(self, config: DFlash2DraftConfig):
        super().__init__()
        h, self.taps = config.hidden_size, config.conv_kernel_size
        self.groups, self.block_size = h // config.conv_group_size, config.block_size
        self.base_kernel = nn.Parameter(torch.empty(2, self.taps, h))  # [side, tap, channel]
        self.kernel_projection = KernelProjection(h, 2 * self.taps * self.groups, bias=False)

    def reset_parameters(self) -> None:
        """The identity: tap 0 passes each channel through, every other tap and every delta is 0."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def prepare(self, normed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Side 0 applied to the sublayer's input `normed` [B, Q, H] (Q a whole number of blocks), and the
        deltas [B, Q, 2, taps, groups] that `finish` applies to the sublayer's output."""
        deltas = self.kernel_projection(normed).unflatten(-1, (2, self.taps, self.groups))
        return self._convolve(normed, 0, deltas[:, :, 0]), deltas

    def finish(self, output: torch.Tensor, deltas: torch.Tensor) -> torch.Tensor:
        """Side 1 applied to the sublayer's output [B, Q, H], with the deltas of its input."""
        return self._convolve(output, 1, deltas[:, :, 1])

    def _convolve(self, x: torch.Tensor, side: int, delta: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            # keep x and the deltas only: the kernels ([taps, H] per position) and the shifted copies of x
            # are recomputed in backward
            return checkpoint(
                self._convolution, x, side, delta, use_reentrant=False, preserve_rng_state=False
            )
        return self._convolution(x, side, delta)

    def _convolution(self, x: torch.Tensor, side: int, delta: torch.Tensor) -> torch.Tensor:
        batch, q_len, h = x.shape
        if q_len % self.block_size:  # positions in block are counted from the first query on
            raise ValueError(f"{q_len} draft positions are not whole blocks of {self.block_size}")
        grouped = x.view(batch, q_len, self.groups, h // self.groups)
        kernel = (
            self.base_kernel[side].view(self.taps, self.groups, -1) + delta[..., None]
        )  # [B, Q, taps, G, g]
        out = kernel[:, :, 0] * grouped
        position = torch.arange(q_len, device=x.device) % self.block_size
        for tap in range(1, self.taps):
            earlier = F.pad(grouped[:, :-tap], (0, 0, 0, 0, tap, 0))  # x[i - tap]
            out = out + kernel[:, :, tap] * earlier * (position >= tap).view(1, q_len, 1, 1)
        return out.flatten(-2).to(x.dtype)


class DFlash2DecoderLayer(DFlashDecoderLayer):
    """A DFlash layer whose attention and MLP each sit between the two sides of a dynamic convolution:
    h + finish(attention(prepare(norm(h)))), then the same around the MLP. The block's queries, keys and
    values come from the convolved input; the context's keys and values do not pass through it."""

    def __init__(self, config: DFlash2DraftConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.attention_conv = DynamicConvolution(config)
        self.mlp_conv = DynamicConvolution(config)
        self._compiled_before_attention = None  # `compile_regions`

    def compile_regions(self, backend) -> None:
        """Compile the chains around attention (`DFlashDraftModel.compile_regions`): before it the norm, the
        attention convolution's first side, the projections, q/k norms and rope; after it o_proj, the
        convolution's second side, the residual and the whole MLP half with its own convolution. The
        convolutions keep their recomputation inside the graphs (their kernels are [taps, H] per position)."""
        self._compiled_before_attention = torch.compile(
            self._before_attention, backend=backend, fullgraph=True
        )
        self._compiled_after_attention = torch.compile(self._after_attention, backend=backend, fullgraph=True)

    def _before_attention(self, hidden, context, cos, sin):
        """Roped q, k, v of the convolved, normed block (`DFlashAttention._qkv`), the convolution's deltas."""
        normed, deltas = self.attention_conv.prepare(self.input_layernorm(hidden))
        return (*self.self_attn._qkv(normed, context, cos, sin, _NORMED_ALREADY), deltas)

    def _after_attention(self, hidden, heads, deltas):
        attended = self.self_attn.o_proj(heads.flatten(2))
        return self._mlp_half(hidden + self.attention_conv.finish(attended, deltas))

    def _mlp_half(self, hidden):
        normed, deltas = self.mlp_conv.prepare(self.post_attention_layernorm(hidden))
        if self.mlp.recompute and torch.is_grad_enabled():  # keep the MLP's input only, as DFlash's does
            transformed = checkpoint(
                self.mlp.transform, normed, use_reentrant=False, preserve_rng_state=False
            )
        else:
            transformed = self.mlp.transform(normed)
        return hidden + self.mlp_conv.finish(transformed, deltas)

    def forward(self, hidden, context, cos, sin, mask, cache=None):
        compiled = self._compiled_after_attention is not None and not self.mlp.recompute
        if compiled and cache is None and torch.is_grad_enabled():
            *qkv, deltas = self._compiled_before_attention(*dynamic_lengths(hidden, context, cos, sin))
            heads = attend(*qkv, mask).transpose(1, 2)
            return self._compiled_after_attention(*dynamic_lengths(hidden, heads, deltas))
        normed, deltas = self.attention_conv.prepare(self.input_layernorm(hidden))
        attended = self.self_attn(normed, _NORMED_ALREADY, context, cos, sin, mask, cache)
        return self._mlp_half(hidden + self.attention_conv.finish(attended, deltas))


class DFlash2DraftModel(DFlashDraftModel):
    """The DFlash2 drafter: DFlash2 layers, and the candidate selector after the final norm."""

    config_class = DFlash2DraftConfig
    layer_class = DFlash2DecoderLayer
    _no_split_modules = ["DFlash2DecoderLayer"]
    embedding_tables = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")

    def __init__(self, config: DFlash2DraftConfig):
        super().__init__(config)  # the backbone, initialised as DFlash's (see _init_weights)
        self.candidate_selector = CandidateSelector(
            config.hidden_size, config.vocab_size, config.selector_rank, config.selector_top_k
        )
        self.candidate_selector.reset_parameters(config.initializer_range)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, DynamicConvolution):
            module.reset_parameters()
        elif not isinstance(module, KernelProjection):  # zeroed by its convolution: no random numbers drawn
            super()._init_weights(module)

    def loss_terms(self, last_hidden, head_weight, inputs, settings):
        """The LM head's loss plus the candidate selector's (selector.py)."""
        return selector_terms(self, last_hidden, head_weight, inputs, settings)

    def draft_logits(self, hidden: torch.Tensor, head: nn.Module) -> torch.Tensor:
        """Not defined: a DFlash2 draft is a walk through its selector's candidates, each conditioned on the one
        before, and this project's decoder samples DFlash's independent positions only."""
        raise ValueError(
            "sampling (--temperature > 0) with a DFlash2 drafter: its selector's walk is not sampled by this "
            "project's decoder; evaluate it greedily (--temperature 0)"
        )

    def draft_tokens(self, hidden: torch.Tensor, head: nn.Module, anchor: torch.Tensor) -> torch.Tensor:
        """The block's drafted tokens by the selector's greedy walk, the anchor being the first predecessor."""
        c = self.config
        return walk(
            self.candidate_selector, hidden, head, anchor, c.output_multiplier, c.final_logit_softcapping
        )
