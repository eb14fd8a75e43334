"""LiLiCorr's lattice correlator: scores the transitions between a block's candidate tokens.

Each drafted slot s (1 .. bs-1) of a block keeps the backbone's K best tokens under the target's LM head. The
(bs-1) x K lattice of candidates runs through a small transformer, as vLLM 0.32 (`lilicorr.py`) and SGLang
serve it:

- a candidate's state: its target input embedding (`token_proj`ed where the head is narrower than the
  model), its slot's backbone output (`pass_hidden_proj`), five features of its log-probability (log p, p,
  log p - max, rank / (K-1), is-top-1) through LayerNorm + MLP, and its slot's and rank's embeddings;
- `num_layers` pre-norm layers of attention over the whole flattened lattice (no causal mask; a learned
  per-head bias by slot distance and for the same slot) and a SiLU MLP;
- the anchor, the drafter's own `hidden_norm` of its combined target features at the last committed
  position (`context_proj`, zeroed where there is none), and each candidate x make a factor input
  [x, a, x * a] -> SiLU -> outgoing and incoming vectors, L2-normalised;
- start[j] = <anchor_out, in[slot 0, j]> and pair[s, i, j] = <out[s, i], in[s + 1, j]>, times
  `logit_scale`: the transition logits of the walk (walk.py), the correlator's alone (the log-probabilities
  are features, not scores).

Initialised so that an untrained correlator drafts exactly what the backbone's LM head drafts: the incoming
head's weight is zero, so every candidate of a slot gets the same incoming vector (its bias), every
transition out of a candidate scores alike, and the walk keeps each slot's first candidate, the LM head's
best; its gradient is not zero, so training moves it at once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

NUM_FEATURES = 5


class LatticeMLP(nn.Module):
    """up -> SiLU -> down, both with biases (vLLM loads it as NemotronHMLP with `hidden_act` silu)."""

    def __init__(self, width: int, inner: int, out: int | None = None):
        super().__init__()
        self.up_proj = nn.Linear(width, inner, bias=True)
        self.down_proj = nn.Linear(inner, out or width, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.up_proj(x)))


class LatticeAttention(nn.Module):
    """Attention over the flattened lattice with an additive bias per head; packed q/k/v as vLLM loads them
    (`in_proj_weight` [3h, h], `in_proj_bias` [3h])."""

    def __init__(self, width: int, num_heads: int):
        super().__init__()
        if num_heads < 1 or width % num_heads:
            raise ValueError(
                f"lilicorr_hidden_size {width} must be divisible by lilicorr_num_heads {num_heads}"
            )
        self.num_heads = num_heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * width, width))
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * width))
        self.out_proj = nn.Linear(width, width, bias=True)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = F.linear(x, self.in_proj_weight, self.in_proj_bias).chunk(3, dim=-1)
        q, k, v = (t.view(batch, length, self.num_heads, -1).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype))
        return self.out_proj(out.transpose(1, 2).reshape(batch, length, width))


class LatticeLayer(nn.Module):
    def __init__(self, width: int, num_heads: int, mlp_ratio: float, eps: float):
        super().__init__()
        self.attn_norm = nn.RMSNorm(width, eps=eps)
        self.attn = LatticeAttention(width, num_heads)
        self.mlp_norm = nn.RMSNorm(width, eps=eps)
        self.mlp = LatticeMLP(width, int(width * mlp_ratio))

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), bias)
        return x + self.mlp(self.mlp_norm(x))


class LatticeCorrelator(nn.Module):
    """The correlator head (module docstring) of a drafter of width `model_width` and block `block_size`;
    `config` holds the `lilicorr_*` fields (LiLiCorrDraftConfig)."""

    def __init__(self, config, model_width: int, block_size: int):
        super().__init__()
        width = config.lilicorr_hidden_size or model_width
        self.width, self.slots, self.block_size = width, block_size - 1, block_size
        self.top_k, heads = config.lilicorr_candidate_topk, config.lilicorr_num_heads
        self.logit_scale, self.vector_eps = config.lilicorr_logit_scale, config.lilicorr_vector_eps
        eps = config.rms_norm_eps
        self.token_proj = nn.Identity() if width == model_width else nn.Linear(model_width, width, bias=True)
        self.pass_hidden_proj = nn.Linear(model_width, width, bias=True)
        self.feature_norm = nn.LayerNorm(NUM_FEATURES)
        self.feature_mlp = LatticeMLP(NUM_FEATURES, width, width)
        self.slot_embedding = nn.Parameter(torch.zeros(1, 1, self.slots, 1, width))
        self.rank_embedding = nn.Parameter(torch.zeros(1, 1, 1, self.top_k, width))
        self.relative_slot_bias = nn.Parameter(torch.zeros(heads, 2 * block_size - 1))
        self.same_slot_bias = nn.Parameter(torch.zeros(heads))
        self.context_proj = nn.Linear(model_width, width, bias=True)
        self.layers = nn.ModuleList(
            LatticeLayer(width, heads, config.lilicorr_mlp_ratio, eps)
            for _ in range(config.lilicorr_num_layers)
        )
        self.output_norm = nn.RMSNorm(width, eps=eps)
        self.anchor_norm = nn.RMSNorm(width, eps=eps)
        self.factor_input_proj = nn.Linear(3 * width, width, bias=True)
        factor = config.lilicorr_factor_dim
        self.out_head = nn.Linear(width, factor, bias=True)
        self.in_head = nn.Linear(width, factor, bias=True)
        self.anchor_out_head = nn.Linear(width, factor, bias=True)

    def reset_parameters(self, std: float) -> None:
        """Matrices and embeddings normal(0, std), biases zero, norms one; the incoming head's weight zero and
        its bias normal (module docstring: an untrained correlator drafts as the LM head)."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
                nn.init.zeros_(module.bias)
            elif isinstance(module, (nn.RMSNorm, nn.LayerNorm)):
                module.reset_parameters()
            elif isinstance(module, LatticeAttention):
                nn.init.normal_(module.in_proj_weight, std=std)
                nn.init.zeros_(module.in_proj_bias)
        for embedding in (self.slot_embedding, self.rank_embedding):
            nn.init.normal_(embedding, std=std)
        nn.init.zeros_(self.relative_slot_bias)
        nn.init.zeros_(self.same_slot_bias)
        nn.init.zeros_(self.in_head.weight)
        nn.init.normal_(self.in_head.bias, std=1.0)

    def attention_bias(self, slots: int, device: torch.device) -> torch.Tensor:
        """[heads, slots*K, slots*K]: relative_slot_bias[slot(q) - slot(k) + bs - 1] + same_slot_bias where the
        slots are equal (the offset the full block trained with, also for a shorter lattice)."""
        slot = torch.arange(slots, device=device).repeat_interleave(self.top_k)
        relative = slot[:, None] - slot[None, :] + self.block_size - 1
        same = (slot[:, None] == slot[None, :]).to(self.same_slot_bias.dtype)
        return self.relative_slot_bias[:, relative] + same * self.same_slot_bias[:, None, None]

    def forward(
        self,
        embeddings: torch.Tensor,
        log_probs: torch.Tensor,
        slot_hidden: torch.Tensor,
        anchor_hidden: torch.Tensor,
        anchor_valid: torch.Tensor,
    ) -> torch.Tensor:
        """[B, S, K, K] transition logits of a lattice of S slots: row [s, i] scores slot s's candidates after
        candidate i of slot s-1 (for s = 0 after the anchor, the same for every i). `embeddings` [B, S, K, Hm]
        are the candidates' target input embeddings, `log_probs` [B, S, K] their LM-head log-probabilities
        (best first), `slot_hidden` [B, S, Hm] the backbone's final-normed outputs, `anchor_hidden` [B, Hm]
        and `anchor_valid` [B] the anchor's state and whether it has one."""
        batch, slots, k = log_probs.shape
        log_probs = log_probs.float()
        rank = torch.arange(k, device=log_probs.device, dtype=torch.float32) / max(k - 1, 1)
        features = torch.stack(
            [
                log_probs,
                log_probs.exp(),
                log_probs - log_probs.max(dim=-1, keepdim=True).values,
                rank.expand_as(log_probs),
                (rank == 0).float().expand_as(log_probs),
            ],
            dim=-1,
        )
        states = self.token_proj(embeddings) + self.pass_hidden_proj(slot_hidden)[:, :, None]
        states = states + self.feature_mlp(self.feature_norm(features.to(states.dtype)))
        states = states + self.slot_embedding[:, 0, :slots] + self.rank_embedding[:, 0]
        states = states.reshape(batch, slots * k, self.width)
        bias = self.attention_bias(slots, states.device)[None]
        for layer in self.layers:
            states = layer(states, bias)
        states = self.output_norm(states).view(batch, slots, k, self.width)
        anchor = self.anchor_norm(self.context_proj(anchor_hidden) * anchor_valid[:, None].to(states.dtype))
        row = anchor[:, None, None]
        w_self, w_anchor, w_cross = self.factor_input_proj.weight.split(self.width, dim=1)
        pre = F.linear(states, w_self, self.factor_input_proj.bias) + F.linear(row, w_anchor)
        factor = F.silu(pre + F.linear(states * row, w_cross))
        out_vec = F.normalize(self.out_head(factor), dim=-1, eps=self.vector_eps)
        in_vec = F.normalize(self.in_head(factor), dim=-1, eps=self.vector_eps)
        anchor_out = F.normalize(self.anchor_out_head(anchor), dim=-1, eps=self.vector_eps)
        start = (anchor_out[:, None] * in_vec[:, 0]).sum(dim=-1)  # [B, K]
        pairs = out_vec[:, :-1] @ in_vec[:, 1:].transpose(-1, -2)  # [B, S-1, K, K]
        first = start[:, None, None].expand(batch, 1, k, k)
        return self.logit_scale * torch.cat([first, pairs], dim=1).float()
