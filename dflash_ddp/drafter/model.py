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

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from dflash_ddp.drafter.attention import BlockLayout, DecodeWindow, LayerMasks, attend
from dflash_ddp.drafter.config import DFlashDraftConfig
from dflash_ddp.drafter.flex import BlockMask
from dflash_ddp.drafter.objective import block_loss_terms, head_logits


def _rms_normed(x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    """w * (x / rms(x)) in x's dtype; the statistics (`rstd`) in fp32 for half inputs."""
    return (weight * (x.to(rstd.dtype) * rstd).to(x.dtype)).to(x.dtype)


# Values of one piece of a norm's backward when the layers recompute (--recompute qkv_mlp): its temporaries
# stay small next to the activations it runs beside. Keeping everything, the backward runs in one piece.
NORM_PIECE_VALUES = 1 << 20


def _rms_norm_backward(x, weight, rstd, grad, pieces: bool = True):
    """Gradients of `_rms_normed` w.r.t. x (x's dtype) and the weight (fp32 sums, the weight's dtype), in
    pieces of about NORM_PIECE_VALUES values (`pieces`) or all rows at once."""
    acc, shape, width = rstd.dtype, x.shape, x.shape[-1]
    x, grad, rstd = x.reshape(-1, width), grad.reshape(-1, width), rstd.reshape(-1, 1)
    if not pieces:  # no loop: a compiled region keeps its lengths dynamic and fuses the whole chain
        grad_x, grad_weight = _rms_norm_piece_backward(x, weight, rstd, grad)
        return grad_x.to(x.dtype).view(shape), grad_weight.to(weight.dtype)
    grad_x = torch.empty_like(x)
    grad_weight = torch.zeros(width, dtype=acc, device=x.device)
    rows = max(1, NORM_PIECE_VALUES // width)
    for r in range(0, x.shape[0], rows):
        g_x, g_w = _rms_norm_piece_backward(x[r : r + rows], weight, rstd[r : r + rows], grad[r : r + rows])
        grad_weight += g_w
        grad_x[r : r + rows] = g_x
    return grad_x.view(shape), grad_weight.to(weight.dtype)


def _rms_norm_piece_backward(x, weight, rstd, grad):
    """The gradients of rows x [n, width] (in rstd's dtype): w.r.t. x and the weight's sum over the rows."""
    acc = rstd.dtype
    g = grad.to(acc)
    normed = x.to(acc) * rstd
    grad_weight = (g * normed.to(x.dtype).to(acc)).sum(0)
    g = g * weight.to(acc)
    return rstd * (g - normed * (g * normed).mean(-1, keepdim=True)), grad_weight


def _rstd(x: torch.Tensor, eps: float) -> torch.Tensor:
    acc = torch.promote_types(x.dtype, torch.float32)  # fp32 statistics for half inputs
    return torch.rsqrt(x.to(acc).pow(2).mean(-1, keepdim=True) + eps)


class _RMSNormFunction(torch.autograd.Function):
    """y = w * (x / rms(x)), keeping only x and 1/rms for backward (autograd's version keeps x/rms too)."""

    @staticmethod
    def forward(ctx, x, weight, eps, pieces):
        rstd = _rstd(x, eps)
        ctx.save_for_backward(x, weight, rstd)
        ctx.pieces = pieces
        return _rms_normed(x, weight, rstd)

    @staticmethod
    def backward(ctx, grad):
        return (*_rms_norm_backward(*ctx.saved_tensors, grad, ctx.pieces), None, None)


class RMSNorm(nn.Module):
    """Root-mean-square norm as in Qwen3 (statistics in fp32), returning the input's dtype, so that under
    autocast bf16 activations stay bf16 (an fp32 weight times bf16 would otherwise give fp32)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.recompute = True  # the backward in pieces (see `DFlashDraftModel.set_recompute`)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNormFunction.apply(x, self.weight, self.eps, self.recompute)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for arbitrary position ids; rope variants come from transformers' own init functions."""

    def __init__(self, config: DFlashDraftConfig):
        super().__init__()
        rope_type = config.rope_parameters.get("rope_type", "default")
        if rope_type == "default":
            base = config.rope_parameters["rope_theta"]
            # a partial rope (Qwen3.5, Qwen3-Next) turns the first dimensions of each head only
            dim = int(config.head_dim * config.rope_parameters.get("partial_rotary_factor", 1.0))
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
    # x: [B, heads, T, D]; cos/sin: [B, T, R], R <= D: a partial rope turns the first R dimensions only
    rotary = cos.shape[-1]
    if rotary < x.shape[-1]:
        turned, kept = x[..., :rotary], x[..., rotary:]
        return torch.cat((_apply_rope(turned, cos, sin), kept), dim=-1)
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
        self.recompute = True  # q, k and v recomputed in backward (see `DFlashDraftModel.set_recompute`)
        self._compiled_qkv = None  # `compile_projections`

    def _qkv(self, x, context, cos, sin, norm):
        """Roped queries [B, heads, Q, D], roped keys and values [B, kv heads, S + Q, D] of the block's
        pre-norm states x."""
        hidden = norm(x)
        batch, q_len, _ = hidden.shape
        kv_len = context.shape[1] + q_len
        q = self.q_norm(self.q_proj(hidden).view(batch, q_len, self.num_heads, self.head_dim)).transpose(1, 2)
        # context and block projected apart, then joined: no joined copy of the projections' input
        k = torch.cat([self.k_proj(context), self.k_proj(hidden)], dim=1)
        k = self.k_norm(k.view(batch, kv_len, self.num_kv_heads, self.head_dim))
        v = torch.cat([self.v_proj(context), self.v_proj(hidden)], dim=1)
        v = v.view(batch, kv_len, self.num_kv_heads, self.head_dim)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        return _apply_rope(q, cos[:, -q_len:], sin[:, -q_len:]), _apply_rope(k, cos, sin), v

    def compile_projections(self, backend: str) -> None:
        """Compile the part before attention (`DFlashDraftModel.compile_regions`)."""
        self._compiled_qkv = torch.compile(self._qkv, backend=backend, fullgraph=True)

    def forward(self, x, norm, context, cos, sin, mask, cache=None):
        """Attention output (after o_proj) of the block whose pre-norm states are x; `norm` is the layer's
        input norm."""
        return self.o_proj(self.attended_heads(x, norm, context, cos, sin, mask, cache).flatten(2))

    def attended_heads(self, x, norm, context, cos, sin, mask, cache=None):
        """Attention's output per head [B, Q, heads, D], before o_proj (a transposed view of the kernel's)."""
        training = torch.is_grad_enabled() and cache is None
        if self.recompute and training:
            # Training keeps x only: the norm, projections, q/k norms and rope (cheap next to attention) are
            # recomputed in backward, instead of keeping the normed input and q, k before their norms.
            q, k, v = checkpoint(self._qkv, x, context, cos, sin, norm, use_reentrant=False)
        elif self._compiled_qkv is not None and training:
            q, k, v = self._compiled_qkv(*dynamic_lengths(x, context, cos, sin), norm=norm)
        else:
            q, k, v = self._qkv(x, context, cos, sin, norm)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        return attend(q, k, v, mask).transpose(1, 2)


def dynamic_lengths(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`tensors` ([batch, length, ...]) with batch and length marked dynamic before a compiled region: chunks
    differ in rows, draft positions and context, and each new size would otherwise compile another graph."""
    for t in tensors:
        torch._dynamo.maybe_mark_dynamic(t, 0)
        torch._dynamo.maybe_mark_dynamic(t, 1)
    return tensors


# Rows of one piece of the MLP's recomputation in backward: its temporaries (about four [rows, I] tensors)
# stay small next to the saved activations whatever the number of draft positions.
MLP_ROWS = 1024


class _MLPResidual(torch.autograd.Function):
    """h + down(silu(gate(n)) * up(n)) with n = rmsnorm(h), keeping only h and 1/rms for backward.

    Autograd would keep n, gate, up and silu(gate) * up: 2 H + 3 I values per position against H here.
    The backward recomputes n, gate and up in pieces of MLP_ROWS rows (two of the MLP's three matmuls
    again) and works on them in place, so its temporaries do not grow with the positions either. Matmuls
    run in `dtype` (bf16 under autocast), the norm's statistics and the weight gradients' sums in fp32."""

    @staticmethod
    def forward(ctx, h, norm_weight, eps, w_gate, w_up, w_down, dtype):
        flat = h.reshape(-1, h.shape[-1])
        rstd = _rstd(flat, eps)
        out = torch.empty_like(flat)
        wg, wu, wd = (w.to(dtype) for w in (w_gate, w_up, w_down))
        for r in range(0, flat.shape[0], MLP_ROWS):
            x = flat[r : r + MLP_ROWS]
            n = _rms_normed(x, norm_weight, rstd[r : r + MLP_ROWS]).to(dtype)
            gate = n @ wg.T
            act = F.silu(gate).mul_(n @ wu.T)
            out[r : r + MLP_ROWS] = x + (act @ wd.T).to(h.dtype)
        ctx.save_for_backward(h, norm_weight, w_gate, w_up, w_down, rstd)
        ctx.dtype = dtype
        return out.view_as(h)

    @staticmethod
    def backward(ctx, grad):
        h, norm_weight, w_gate, w_up, w_down, rstd = ctx.saved_tensors
        dtype, acc = ctx.dtype, torch.promote_types(ctx.dtype, torch.float32)
        flat, grad = h.reshape(-1, h.shape[-1]), grad.reshape(-1, h.shape[-1])
        wg, wu, wd = (w.to(dtype) for w in (w_gate, w_up, w_down))
        d_wg, d_wu, d_wd = (torch.zeros_like(w, dtype=acc) for w in (w_gate, w_up, w_down))
        d_norm = torch.zeros_like(norm_weight)
        d_h = torch.empty_like(flat)
        for r in range(0, flat.shape[0], MLP_ROWS):
            x, g, rs = flat[r : r + MLP_ROWS], grad[r : r + MLP_ROWS], rstd[r : r + MLP_ROWS]
            n = _rms_normed(x, norm_weight, rs).to(dtype)
            g_c = g.to(dtype)
            gate, up = n @ wg.T, n @ wu.T
            sig = torch.sigmoid(gate)
            t = torch.mul(gate, sig).mul_(up)  # silu(gate) * up: down_proj's input
            d_wd += (g_c.T @ t).to(acc)
            a = torch.mm(g_c, wd, out=t).mul_(sig)  # d(silu * up) * sigmoid
            k = sig.neg_().add_(1).mul_(gate).add_(1)  # 1 + gate (1 - sigmoid)
            d_up = gate.mul_(a)  # d * silu(gate)
            d_gate = a.mul_(up).mul_(k)  # d * up * silu'(gate)
            d_wg += (d_gate.T @ n).to(acc)
            d_wu += (d_up.T @ n).to(acc)
            d_n = (d_gate @ wg).addmm_(d_up, wu)
            d_x, d_w = _rms_norm_backward(x, norm_weight, rs, d_n)
            d_norm += d_w
            d_h[r : r + MLP_ROWS] = g + d_x
        grads = (d.to(w.dtype) for d, w in ((d_wg, w_gate), (d_wu, w_up), (d_wd, w_down)))
        return d_h.view_as(h), d_norm, None, *grads, None


class DFlashMLP(nn.Module):
    """SwiGLU feed-forward."""

    def __init__(self, config: DFlashDraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.recompute = True  # in backward, in pieces of MLP_ROWS (see `DFlashDraftModel.set_recompute`)

    def forward(self, h: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """The MLP half of a layer: h + mlp(norm(h)), in the autocast dtype when autocast is on."""
        if not self.recompute:  # plain autograd keeps n, gate, up and their product: no second pass
            return h + self.transform(norm(h))
        device = h.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else h.dtype
        with torch.autocast(device, enabled=False):
            weights = (self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight)
            return _MLPResidual.apply(h, norm.weight, norm.eps, *weights, dtype)

    def transform(self, n: torch.Tensor) -> torch.Tensor:
        """mlp(n) alone, with plain autograd: for layers that change the MLP's input and output (DFlash2)."""
        return self.down_proj(F.silu(self.gate_proj(n)) * self.up_proj(n))


class DFlashDecoderLayer(nn.Module):
    """Pre-norm layer; the context enters only as extra keys/values, never through the MLP or o_proj."""

    def __init__(self, config: DFlashDraftConfig, layer_idx: int):
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = DFlashMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self._compiled_after_attention = None  # `compile_regions`

    def compile_regions(self, backend: str) -> None:
        """Compile the chains around attention (`DFlashDraftModel.compile_regions`): the norm, projections,
        q/k norms and rope before it; o_proj, the residual, the norm, the MLP and its residual after it."""
        self.self_attn.compile_projections(backend)
        self._compiled_after_attention = torch.compile(self._after_attention, backend=backend, fullgraph=True)

    def _after_attention(self, hidden: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.self_attn.o_proj(heads.flatten(2))
        return self.mlp(hidden, self.post_attention_layernorm)

    def forward(self, hidden, context, cos, sin, mask, cache=None):
        compiled = self._compiled_after_attention is not None and not self.mlp.recompute
        if compiled and cache is None and torch.is_grad_enabled():
            heads = self.self_attn.attended_heads(hidden, self.input_layernorm, context, cos, sin, mask)
            return self._compiled_after_attention(*dynamic_lengths(hidden, heads))
        hidden = hidden + self.self_attn(hidden, self.input_layernorm, context, cos, sin, mask, cache)
        return self.mlp(hidden, self.post_attention_layernorm)


class DFlashDraftModel(PreTrainedModel):
    """The trainable drafter: decoder layers, context fusion (`fc` + `hidden_norm`) and the final norm."""

    config_class = DFlashDraftConfig
    layer_class = DFlashDecoderLayer
    base_model_prefix = ""
    main_input_name = "noise_embeds"
    _no_split_modules = ["DFlashDecoderLayer"]
    supports_gradient_checkpointing = True
    embedding_tables: tuple[
        str, ...
    ] = ()  # parameters that are lookup tables (the optimizer keeps them on AdamW)

    def __init__(self, config: DFlashDraftConfig):
        super().__init__(config)
        num_taps = len(config.target_layer_ids)
        self.layers = nn.ModuleList(self.layer_class(config, i) for i in range(config.num_hidden_layers))
        self.fc = nn.Linear(num_taps * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)
        self.gradient_checkpointing = False  # per layer (--gradient_checkpointing)
        self.recomputes = True  # `set_recompute`
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)

    def set_recompute(self, recompute: bool) -> None:
        """Whether the layers recompute in backward what is cheap to recompute (q, k and v, the MLP in pieces of
        rows, a norm's backward in pieces; DFlash2's convolutions): less memory, more and smaller kernels.
        Without it autograd keeps every activation (--recompute, chosen by the plan; docs/design.md)."""
        self.recomputes = recompute
        for module in self.modules():
            if hasattr(module, "recompute"):
                module.recompute = recompute

    def compile_regions(self, backend: str = "inductor") -> None:
        """Compile each layer's elementwise chains (before attention: the norm, projections, q/k norms and
        rope; after it: o_proj, the residuals, the norm and the MLP) into fused kernels with torch.compile;
        attention keeps its own kernel. Training only: decoding with a cache runs eagerly. For layers that keep
        their activations (`set_recompute(False)`): the recomputing pieces loop in Python, which a compiled
        graph would unroll."""
        for layer in self.layers:
            layer.compile_regions(backend)

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
            [B, 1, Q, S + Q] visibility mask, a BlockLayout or a BlockMask (see `attention.attend`); with
            sliding-window layers, in training, LayerMasks (one of those for each kind of layer).
        cache: a transformers DynamicCache-like object with `update(k, v, layer_idx)`.
        """
        if position_ids.dim() == 1:
            position_ids = position_ids.unsqueeze(0)
        if position_ids.shape[-1] != context_hidden_states.shape[1] + noise_embeds.shape[1]:
            raise ValueError(
                f"position_ids covers {position_ids.shape[-1]} positions, expected context "
                f"{context_hidden_states.shape[1]} + block {noise_embeds.shape[1]}"
            )
        masks = self._layer_masks(_padding_mask_to_visibility(attention_mask), position_ids, noise_embeds)
        features = context_hidden_states
        # under autocast fc reads bf16 features as they are; otherwise they take the weights' dtype
        if not torch.is_autocast_enabled(features.device.type):
            features = features.to(self.fc.weight.dtype)
        context = self.combine_context(features)
        hidden = noise_embeds.to(context.dtype)
        cos, sin = self.rotary_emb(position_ids, hidden.dtype)
        for layer, mask in zip(self.layers, masks, strict=True):
            if self.gradient_checkpointing and torch.is_grad_enabled():
                # keep only the layer's input; its activations are recomputed in backward
                hidden = checkpoint(layer, hidden, context, cos, sin, mask, cache, use_reentrant=False)
            else:
                hidden = layer(hidden, context, cos, sin, mask, cache)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden))

    def combine_context(self, features: torch.Tensor) -> torch.Tensor:
        """The tapped target features [B, S, K*H] combined into the context the layers attend to [B, S, H]."""
        return self.hidden_norm(self.fc(features))

    def bind_target(self, embedding: nn.Module) -> None:
        """The target's input embedding, for a family whose head reads candidates' embeddings (LiLiCorr);
        DFlash reads its block's embeddings from its input alone."""

    def _layer_masks(self, mask, position_ids: torch.Tensor, noise_embeds: torch.Tensor) -> list:
        """Each layer's mask: `mask` for every layer without sliding windows; with them, a training chunk's
        LayerMasks are split by layer kind, and in decoding a sliding layer adds its window to `mask`
        (a DecodeWindow, resolved once the cache has added the keys)."""
        config = self.config
        if isinstance(mask, LayerMasks):
            return [mask.sliding if config.window_of(i) else mask.full for i in range(len(self.layers))]
        if not config.slides:
            return [mask] * len(self.layers)
        if isinstance(mask, (BlockLayout,) if BlockMask is None else (BlockLayout, BlockMask)):
            raise ValueError("a drafter with sliding-window layers trains on LayerMasks, one mask per kind")
        sliding = DecodeWindow(position_ids, noise_embeds.shape[1], config.sliding_window, mask)
        return [sliding if config.window_of(i) else mask for i in range(len(self.layers))]

    def loss_terms(self, last_hidden: torch.Tensor, head_weight: torch.Tensor, inputs, settings):
        """The training loss sums of one chunk's output (objective.py): DFlash scores each block position
        through the target's LM head on its own."""
        return block_loss_terms(last_hidden, head_weight, inputs, settings)

    def draft_tokens(self, hidden: torch.Tensor, head: nn.Module, anchor: torch.Tensor) -> torch.Tensor:
        """The block's drafted tokens [1, block_size - 1] from its output `hidden` [1, block_size, H]: DFlash
        takes each position's argmax under the target's LM head `head`; `anchor` [1, 1] is unused here."""
        return head(hidden[:, 1:].to(head.weight.dtype)).argmax(dim=-1)

    def sample_drafts(self, hidden, head, anchor, draw_from) -> tuple[torch.Tensor, torch.Tensor]:
        """Drafts [1, block_size - 1] drawn by `draw_from(logits [n, V])` -> (tokens [n], probs [n, V]) and the
        distributions q [block_size - 1, V] they were drawn from: DFlash draws every position at once from its
        `draft_logits`; `anchor` [1, 1] is unused here."""
        tokens, probs = draw_from(self.draft_logits(hidden, head))
        return tokens[None], probs

    def confidences(self, hidden: torch.Tensor, previous: torch.Tensor) -> torch.Tensor | None:
        """The drafted positions' predicted acceptance, where the family has a confidence head (DSpark's);
        DFlash has none."""
        return None

    def draft_logits(self, hidden: torch.Tensor, head: nn.Module) -> torch.Tensor:
        """[block_size - 1, V] fp32 logits of the drafted positions (outputs 1.. of `hidden` [1, block_size,
        H]) as the target computes its own (its logit scale and soft-capping), for sampling."""
        c = self.config
        return head_logits(hidden[0, 1:], head.weight, c.logit_scale, c.final_logit_softcapping)


def _padding_mask_to_visibility(attention_mask):
    """A 2-D 0/1 key padding mask (as transformers' generate passes it) becomes a boolean key mask."""
    training_masks = (BlockLayout, LayerMasks) if BlockMask is None else (BlockLayout, LayerMasks, BlockMask)
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
