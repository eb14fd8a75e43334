"""The DFlash drafter: Qwen3-style layers whose keys/values also read the fused target context.

One forward takes the embeddings of block tokens (`[anchor, MASK, ...]`, embedded with the target's
frozen embedding) and the concatenated hidden states of the tapped target layers, and returns the
final-normed hidden states of the block tokens. The target's LM head turns them into logits; the
drafter owns neither the embedding nor the LM head.

The same `forward` serves training (a `BlockLayout` for the block-sparse path, a flex-attention
BlockMask, or a 4-D boolean mask, each describing many blocks per sequence) and inference (a
`transformers` cache holding previous context keys/values, as `generate(..., speculation_type="dflash")`
calls it).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from .attention import BlockLayout, BlockMask, attend


class DFlashDraftConfig(PretrainedConfig):
    """Shape of a DFlash drafter. Width follows the target; depth, taps, mask and block are DFlash's own."""

    model_type = "dflash_draft"

    def __init__(
        self,
        vocab_size: int = 151936,
        hidden_size: int = 4096,
        intermediate_size: int = 12288,
        num_hidden_layers: int = 5,
        num_attention_heads: int = 32,
        num_key_value_heads: int = 8,
        head_dim: int = 128,
        hidden_act: str = "silu",
        rms_norm_eps: float = 1e-6,
        max_position_embeddings: int = 40960,
        rope_parameters: dict | None = None,
        initializer_range: float = 0.02,
        num_target_layers: int = 36,
        target_layer_ids: Sequence[int] = (1, 9, 17, 25, 33),
        mask_token_id: int = 151669,
        block_size: int = 16,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim
        self.hidden_act = hidden_act
        self.rms_norm_eps = rms_norm_eps
        self.max_position_embeddings = max_position_embeddings
        self.rope_parameters = dict(rope_parameters or {"rope_type": "default", "rope_theta": 1000000.0})
        self.initializer_range = initializer_range
        self.num_target_layers = num_target_layers
        self.target_layer_ids = list(target_layer_ids)
        self.mask_token_id = mask_token_id
        self.block_size = block_size
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)


class _RMSNormFunction(torch.autograd.Function):
    """y = w * (x / rms(x)), keeping only x and 1/rms for backward (autograd's version keeps x/rms too)."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        acc = torch.promote_types(x.dtype, torch.float32)  # fp32 statistics for half inputs
        rstd = torch.rsqrt(x.to(acc).pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return (weight * (x.to(acc) * rstd).to(x.dtype)).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        acc = rstd.dtype
        normed = x.to(acc) * rstd
        grad_normed = grad.to(acc) * weight.to(acc)
        grad_weight = (grad.to(acc) * normed.to(x.dtype).to(acc)).flatten(0, -2).sum(0).to(weight.dtype)
        grad_x = rstd * (grad_normed - normed * (grad_normed * normed).mean(-1, keepdim=True))
        return grad_x.to(x.dtype), grad_weight, None


class RMSNorm(nn.Module):
    """Root-mean-square norm as in Qwen3 (statistics in fp32), returning the input's dtype, so that under
    autocast bf16 activations stay bf16 (an fp32 weight times bf16 would otherwise give fp32)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNormFunction.apply(x, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for arbitrary position ids; rope variants come from transformers' own init functions."""

    def __init__(self, config: DFlashDraftConfig):
        super().__init__()
        rope_type = config.rope_parameters.get("rope_type", "default")
        if rope_type == "default":
            base = config.rope_parameters["rope_theta"]
            dim = config.head_dim
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            self.attention_scaling = 1.0
        else:
            inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def _apply(self, fn, recurse=True):
        inv_freq = self.inv_freq
        super()._apply(fn, recurse)
        # A dtype cast of the drafter (e.g. to bf16) must not round the rope frequencies; device moves apply.
        self.inv_freq = inv_freq.to(self.inv_freq.device)
        return self

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(position_ids.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, heads, T, D]; cos/sin: [B, T, D]
    return x * cos[:, None] + _rotate_half(x) * sin[:, None]


class DFlashAttention(nn.Module):
    """Queries from block tokens; keys/values from the fused context AND the block (KV injection)."""

    def __init__(self, config: DFlashDraftConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        h, d = config.hidden_size, config.head_dim
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)

    def forward(self, hidden, context, cos, sin, mask, cache=None):
        batch, q_len, _ = hidden.shape
        kv_input = torch.cat([context, hidden], dim=1)
        kv_len = kv_input.shape[1]
        q = self.q_norm(self.q_proj(hidden).view(batch, q_len, self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(kv_input).view(batch, kv_len, self.num_kv_heads, self.head_dim))
        v = self.v_proj(kv_input).view(batch, kv_len, self.num_kv_heads, self.head_dim)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        q = _apply_rope(q, cos[:, -q_len:], sin[:, -q_len:])
        k = _apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        out = attend(q, k, v, mask)
        return self.o_proj(out.transpose(1, 2).reshape(batch, q_len, -1))


class _SiLUMul(torch.autograd.Function):
    """silu(gate) * up, keeping gate and up for backward (autograd would also keep silu(gate))."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        sig = torch.sigmoid(gate)
        silu = gate * sig
        return grad * up * sig * (1 + gate * (1 - sig)), grad * silu


class DFlashMLP(nn.Module):
    """SwiGLU feed-forward."""

    def __init__(self, config: DFlashDraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(_SiLUMul.apply(self.gate_proj(x), self.up_proj(x)))


class DFlashDecoderLayer(nn.Module):
    """Pre-norm layer; the context enters only as extra keys/values, never through the MLP or o_proj."""

    def __init__(self, config: DFlashDraftConfig, layer_idx: int):
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = DFlashMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden, context, cos, sin, mask, cache=None):
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), context, cos, sin, mask, cache)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DFlashDraftModel(PreTrainedModel):
    """The trainable drafter: decoder layers, context fusion (`fc` + `hidden_norm`) and the final norm."""

    config_class = DFlashDraftConfig
    base_model_prefix = ""
    main_input_name = "noise_embeds"
    _no_split_modules = ["DFlashDecoderLayer"]
    supports_gradient_checkpointing = True

    def __init__(self, config: DFlashDraftConfig):
        super().__init__(config)
        num_taps = len(config.target_layer_ids)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.fc = nn.Linear(num_taps * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)
        self.gradient_checkpointing = False  # per layer (--gradient_checkpointing)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)

    def forward(
        self,
        noise_embeds: torch.Tensor,
        context_hidden_states: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask=None,
        cache=None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        """Draft hidden states for the block tokens.

        noise_embeds: [B, Q, H] target embeddings of the block tokens.
        context_hidden_states: [B, S, K*H] tapped target features (new context only when `cache` holds the rest).
        position_ids: [B, S + Q] positions of the context tokens, then of the block tokens.
        attention_mask: None, a [B, S_total] padding mask of ones/zeros (transformers' generate), a boolean
            [B, 1, Q, S + Q] visibility mask, a BlockLayout or a BlockMask (see `attention.attend`).
        cache: a transformers DynamicCache-like object with `update(k, v, layer_idx)`.
        """
        if position_ids.dim() == 1:
            position_ids = position_ids.unsqueeze(0)
        if position_ids.shape[-1] != context_hidden_states.shape[1] + noise_embeds.shape[1]:
            raise ValueError(
                f"position_ids covers {position_ids.shape[-1]} positions, expected context "
                f"{context_hidden_states.shape[1]} + block {noise_embeds.shape[1]}"
            )
        mask = _padding_mask_to_visibility(attention_mask)
        features = context_hidden_states
        # under autocast fc reads bf16 features as they are; otherwise they take the weights' dtype
        if not torch.is_autocast_enabled(features.device.type):
            features = features.to(self.fc.weight.dtype)
        context = self.hidden_norm(self.fc(features))
        hidden = noise_embeds.to(context.dtype)
        cos, sin = self.rotary_emb(position_ids, hidden.dtype)
        for layer in self.layers:
            if self.gradient_checkpointing and torch.is_grad_enabled():
                # keep only the layer's input; its activations are recomputed in backward
                hidden = checkpoint(layer, hidden, context, cos, sin, mask, cache, use_reentrant=False)
            else:
                hidden = layer(hidden, context, cos, sin, mask, cache)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden))


def _padding_mask_to_visibility(attention_mask):
    """A 2-D 0/1 key padding mask (as transformers' generate passes it) becomes a boolean key mask."""
    training_masks = (BlockLayout,) if BlockMask is None else (BlockLayout, BlockMask)
    if attention_mask is None or isinstance(attention_mask, training_masks):
        return attention_mask
    if attention_mask.dim() == 2:
        if bool(attention_mask.all()):
            return None
        return attention_mask.bool()[:, None, None, :]
    return attention_mask


def trainable_state_dict(model: DFlashDraftModel) -> dict[str, torch.Tensor]:
    """The drafter's weights as the checkpoint and the z-lab export store them (no buffers)."""
    return {name: p.detach() for name, p in model.named_parameters()}
