"""The LiLiCorr drafter (arXiv 2608.20530; trained in NVIDIA Model-Optimizer, served by vLLM 0.32 as
`LiLiCorrDraftModel` and by SGLang): DFlash's backbone (with `--lilicorr_conv`, DFlash2's grouped
convolutions in every layer) and a lattice correlator (lattice.py) that reranks the block's candidates.

- Candidates: each drafted slot's K best tokens under the target's LM head (raw logits, as vLLM's candidate
  logits processor) and their full-vocabulary log-probabilities.
- Decoding (`draft_tokens`, `sample_drafts`): a walk left to right through the correlator's transition
  logits, from the anchor: greedy takes each row's best (the first among equals), sampling draws from
  softmax(row / T) over the slot's K candidates, the distribution rejection sampling then uses, as vLLM's
  DFlash2/LiLiCorr candidate walk does.
- Training (`lattice_terms`), the reference's objective: the backbone's own LM-head loss plus, teacher-forced
  along the data's tokens, the weighted sum of the correlator's K-way cross-entropy at each slot given the
  true predecessor, a hinge on the true candidate's margin over the best other, and a penalty on the
  probability it puts on candidates the target scores below the true one (the target's log-probabilities
  from --target_topk; a candidate outside the target's top-k takes its k-th). A slot counts only while the
  true token has been a candidate at every slot up to it, and a block only when all its slots are scored
  (the reference's forced prefix and valid blocks). The candidates' log-probabilities come differentiable
  from the LM-head loss's own pass over the logits (objective.py), so the correlator's loss also trains the
  backbone; the candidates' ids and embeddings are constants. Accuracy and the estimated tau are the walk's.

An untrained correlator drafts exactly as the LM head does (lattice.py), so a DFlash or DFlash2 drafter
grown into LiLiCorr (--init_from) starts as itself. Every added weight is drawn after the backbone's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflash_ddp.drafter.blocks import BlockInputs
from dflash_ddp.drafter.config import DFlashDraftConfig
from dflash_ddp.drafter.dflash2 import (
    DFlash2DecoderLayer,
    DFlash2DraftConfig,
    DynamicConvolution,
    KernelProjection,
)
from dflash_ddp.drafter.lattice import LatticeCorrelator
from dflash_ddp.drafter.model import DFlashDecoderLayer, DFlashDraftModel
from dflash_ddp.drafter.objective import LossTerms, best_first, loss_terms, scored_rows
from dflash_ddp.drafter.weighting import LossSettings

# the penalty reads the target's scores of the candidates: --drafter lilicorr takes the target's top 64
TARGET_TOPK = 64
LILICORR_FIELDS = (
    "lilicorr_candidate_topk",
    "lilicorr_hidden_size",
    "lilicorr_num_heads",
    "lilicorr_mlp_ratio",
    "lilicorr_num_layers",
    "lilicorr_factor_dim",
    "lilicorr_vector_eps",
    "lilicorr_logit_scale",
)


class LiLiCorrDraftConfig(DFlashDraftConfig):
    """Shape of a LiLiCorr drafter: a DFlash drafter's (DFlash2's layers where the convolutions are on),
    plus its correlator. The defaults are Model-Optimizer's recipe."""

    model_type = "lilicorr_draft"
    family = "lilicorr"
    run_settings = (*LILICORR_FIELDS, "conv_kernel_size", "conv_group_size")
    serving_fields = ("lilicorr_enabled", *run_settings)
    # vLLM reads these with defaults: enabled, and no convolutions
    optional_serving = {"lilicorr_enabled": True, "conv_kernel_size": 0, "conv_group_size": 0}

    lilicorr_enabled: bool = True
    lilicorr_candidate_topk: int = 8
    lilicorr_hidden_size: int = 1024  # 0: the drafter's width
    lilicorr_num_heads: int = 8
    lilicorr_mlp_ratio: float = 2.0
    lilicorr_num_layers: int = 2
    lilicorr_factor_dim: int = 1024
    lilicorr_vector_eps: float = 1e-4
    lilicorr_logit_scale: float = 8.0
    conv_kernel_size: int = 0  # 0 and 0: DFlash's layers; both set: DFlash2's convolutions
    conv_group_size: int = 0

    @classmethod
    def run_values(cls, run) -> dict:
        """The correlator's settings, and DFlash2's convolution settings where --lilicorr_conv is on."""
        values = {name: getattr(run, name) for name in LILICORR_FIELDS}
        convolved = run.lilicorr_conv
        values["conv_kernel_size"] = run.conv_kernel_size if convolved else 0
        values["conv_group_size"] = run.conv_group_size if convolved else 0
        return values

    @property
    def convolved(self) -> bool:
        return bool(self.conv_kernel_size)

    def settings_to_match(self, source: DFlashDraftConfig) -> tuple[str, ...]:
        """The convolutions' settings only where both drafters have them: growing them in (they start as the
        identity) or leaving them out (their tensors dropped) is a change of parts, as DFlash to DFlash2."""
        return self.run_settings if self.convolved and source.convolved else LILICORR_FIELDS

    def shape_errors(self) -> list[str]:
        """What makes this shape unservable, each naming the setting to change (empty when it is sound)."""
        errors = super().shape_errors()
        k, width = self.lilicorr_candidate_topk, self.lilicorr_hidden_size or self.hidden_size
        if not 1 <= k <= 16 or k & (k - 1):
            errors.append(
                f"lilicorr_candidate_topk {k} must be a power of two <= 16 (vLLM and SGLang refuse others)"
            )
        if self.lilicorr_num_heads < 1 or width % self.lilicorr_num_heads:
            errors.append(
                f"lilicorr_num_heads {self.lilicorr_num_heads} must divide the correlator's width {width}"
            )
        if not self.lilicorr_enabled:
            errors.append(
                "lilicorr_enabled false: the engines serve a LiLiCorr drafter only with its correlator"
            )
        if bool(self.conv_kernel_size) != bool(self.conv_group_size):
            errors.append("conv_kernel_size and conv_group_size: set both (--lilicorr_conv) or neither")
        elif self.convolved:
            if not 1 <= self.conv_kernel_size <= self.block_size:
                errors.append(
                    f"conv_kernel_size {self.conv_kernel_size} must be in [1, block_size {self.block_size}]"
                )
            if self.conv_group_size < 1 or self.hidden_size % self.conv_group_size:
                errors.append(
                    f"conv_group_size {self.conv_group_size} must divide the hidden size {self.hidden_size}"
                )
        return errors

    def extra_saved_per_position(self) -> int:
        return DFlash2DraftConfig.extra_saved_per_position(self) if self.convolved else 0

    def kept_normed_inputs_per_position(self) -> int:
        return 0 if self.convolved else super().kept_normed_inputs_per_position()

    def extra_backward_per_position(self) -> int:
        return DFlash2DraftConfig.extra_backward_per_position(self) if self.convolved else 0

    def extra_loss_bytes(self, rows: int, positions: int, dtype_bytes: int) -> int:
        """The correlator's loss, over the whole chunk whatever the loss's pieces: the candidates' embeddings
        [positions, K, H], each row's expected head row kept for the log-probabilities' gradient
        [positions, H], and the lattice's fp32 states per candidate: about five of its width w and five of
        the factor width f around the layers, and in each layer 3.5 + 2 x mlp_ratio of width w and its
        attention's probabilities over the block's lattice (heads x (bs - 1) x K). Fitted to CPU runs of
        4096 positions x 8 candidates at w and f of 256 and 1024 and 0-3 layers: the whole drafter's peak
        1.01-1.11x the measured."""
        k, width = self.lilicorr_candidate_topk, self.lilicorr_hidden_size or self.hidden_size
        around = 5 * width + 5 * self.lilicorr_factor_dim
        per_layer = (3.5 + 2 * self.lilicorr_mlp_ratio) * width + self.lilicorr_num_heads * (
            self.block_size - 1
        ) * k
        lattice = int(positions * k * 4 * (around + self.lilicorr_num_layers * per_layer))
        return positions * (k + 1) * self.hidden_size * dtype_bytes + lattice


class LiLiCorrDraftModel(DFlashDraftModel):
    """The LiLiCorr drafter: DFlash (or DFlash2) layers, and the correlator `lilicorr` after the final norm."""

    config_class = LiLiCorrDraftConfig
    _no_split_modules = ["DFlashDecoderLayer", "DFlash2DecoderLayer"]

    @property
    def layer_class(self) -> type[nn.Module]:
        return DFlash2DecoderLayer if self.config.convolved else DFlashDecoderLayer

    def __init__(self, config: LiLiCorrDraftConfig):
        super().__init__(
            config
        )  # the backbone, initialised as DFlash's (DFlash2's convolutions as identities)
        self.lilicorr = LatticeCorrelator(config, config.hidden_size, config.block_size)
        self.lilicorr.reset_parameters(config.initializer_range)
        self.context_states: torch.Tensor | None = None  # the last forward's combined target features
        self.target_embedding: torch.Tensor | None = None  # bound by the trainer and the decoder

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, DynamicConvolution):
            module.reset_parameters()
        elif not isinstance(module, KernelProjection):  # zeroed by its convolution: no random numbers drawn
            super()._init_weights(module)

    def combine_context(self, features: torch.Tensor) -> torch.Tensor:
        """As DFlash's, remembered: the anchor's state is the combined features at the last committed
        position (decoding) or at each block's anchor - 1 (training)."""
        self.context_states = super().combine_context(features)
        return self.context_states

    def bind_target(self, embedding: nn.Module) -> None:
        """The target's input embedding, whose rows are the candidates' tokens in the lattice (unscaled, as
        the engines take them)."""
        self.target_embedding = embedding.weight.detach()  # a constant, never one of the drafter's parameters

    def loss_terms(self, last_hidden, head_weight, inputs, settings):
        """The LM head's loss plus the correlator's (module docstring)."""
        return lattice_terms(self, last_hidden, head_weight, inputs, settings)

    def candidates(self, hidden: torch.Tensor, head: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """The drafted slots' K best tokens [1, S, K] (best first, lowest id among equals) and their
        log-probabilities [1, S, K] from the block's output `hidden` [1, bs, H]."""
        log_probs = torch.log_softmax(head(hidden[:, 1:].to(head.weight.dtype)).float(), dim=-1)
        values, ids = best_first(log_probs, self.config.lilicorr_candidate_topk)
        return ids, values

    def transitions(self, hidden: torch.Tensor, ids: torch.Tensor, log_probs: torch.Tensor) -> torch.Tensor:
        """[1, S, K, K] transition logits of a block in decoding, the anchor's state the last committed
        position's combined features."""
        if self.target_embedding is None or self.context_states is None:
            raise ValueError("a LiLiCorr drafter drafts after bind_target() and a forward over the context")
        anchor = self.context_states[:, -1]
        embeddings = self.target_embedding[ids].to(hidden.dtype)
        valid = torch.ones(1, dtype=torch.bool, device=hidden.device)
        return self.lilicorr(embeddings, log_probs, hidden[:, 1:], anchor.to(hidden.dtype), valid)

    @torch.no_grad()
    def draft_tokens(self, hidden: torch.Tensor, head: nn.Module, anchor: torch.Tensor) -> torch.Tensor:
        """The greedy walk (the first of equal scores, as the engines break ties)."""
        ids, log_probs = self.candidates(hidden, head)
        logits = self.transitions(hidden, ids, log_probs)[0]
        previous, tokens = 0, []
        for slot in range(logits.shape[0]):
            previous = int(logits[slot, previous].argmax())
            tokens.append(ids[0, slot, previous])
        return torch.stack(tokens)[None]

    @torch.no_grad()
    def sample_drafts(self, hidden, head, anchor, draw_from) -> tuple[torch.Tensor, torch.Tensor]:
        """The sampled walk: each slot drawn by `draw_from` from its row given the candidate drawn before it,
        as full-vocabulary logits (-inf outside the slot's candidates); the draws and their distributions."""
        ids, log_probs = self.candidates(hidden, head)
        logits = self.transitions(hidden, ids, log_probs)[0]
        previous, tokens, probs = 0, [], []
        for slot in range(logits.shape[0]):
            row = torch.full((1, head.weight.shape[0]), float("-inf"), device=logits.device)
            row[0, ids[0, slot]] = logits[slot, previous]
            token, q = draw_from(row)
            previous = int((ids[0, slot] == token[0]).nonzero()[0])
            tokens.append(token[0])
            probs.append(q[0])
        return torch.stack(tokens)[None], torch.stack(probs)

    def draft_logits(self, hidden: torch.Tensor, head: nn.Module) -> torch.Tensor:
        """Not defined: a LiLiCorr draft is a walk, each slot's distribution given the candidate before it
        (`sample_drafts`)."""
        raise ValueError("a LiLiCorr drafter's drafts are a walk: sample them with sample_drafts")


def _target_scores(inputs: BlockInputs, blocks: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """[nb, S, K] the target's log-probabilities of the candidates `ids` at each slot (its top-k's; a
    candidate outside them takes the k-th's, a bound from above)."""
    soft_ids = inputs.soft_ids.flatten(0, 1)[blocks][:, 1:]  # [nb, S, kt]
    soft_log = inputs.soft_probs.flatten(0, 1)[blocks][:, 1:].float().clamp_min(1e-30).log()
    floor = soft_log.min(dim=-1, keepdim=True).values
    match = ids[..., None] == soft_ids[:, :, None].long()  # [nb, S, K, kt]
    found = match.any(-1)
    scores = (match * soft_log[:, :, None]).sum(-1)
    return torch.where(found, scores, floor.expand_as(scores))


def lattice_terms(
    drafter: LiLiCorrDraftModel,
    last_hidden: torch.Tensor,
    head_weight: torch.Tensor,
    inputs: BlockInputs,
    settings: LossSettings,
) -> LossTerms:
    """LiLiCorr's loss sums for one chunk (module docstring): the LM head's loss of every scored position plus
    the correlator's terms over the blocks whose every slot is scored."""
    c = drafter.config
    k, bs = c.lilicorr_candidate_topk, inputs.block_size
    rows = scored_rows(last_hidden, head_weight, inputs, settings, top_k=k, log_probs=True)
    row_of = torch.full((inputs.weights.numel(),), -1, dtype=torch.long, device=rows.index.device)
    row_of[rows.index] = torch.arange(rows.index.numel(), device=rows.index.device)
    grid = row_of.view(-1, bs)[:, 1:]  # [B*A, S]: each block's slots' rows
    blocks = ((grid >= 0).all(dim=-1) & (inputs.anchors.flatten() >= 0)).nonzero()[:, 0]
    slots = grid[blocks]  # [nb, S]
    ids, labels, weights = rows.candidates[slots], rows.labels[slots], rows.weights[slots]
    hidden, log_probs = rows.hidden[slots], rows.candidate_log_probs[slots]
    anchors = inputs.anchors.flatten()[blocks]
    before = (anchors - 1).clamp_min(0)
    anchor_state = drafter.context_states[blocks // inputs.anchors.shape[1], before]
    embeddings = drafter.target_embedding[ids].detach().to(hidden.dtype)
    logits = drafter.lilicorr(embeddings, log_probs, hidden, anchor_state, anchors >= 1)
    hits = ids == labels[..., None]
    found = hits.any(dim=-1)
    truth = hits.float().argmax(dim=-1)  # the label's place among the candidates (0 where not found)
    forced = torch.cumprod(found.long(), dim=1).bool()  # the true path exists up to here
    previous = F.pad(truth[:, :-1], (1, 0))
    node = logits.gather(2, previous[:, :, None, None].expand(-1, -1, 1, k))[:, :, 0]  # [nb, S, K]
    ce = F.cross_entropy(node.flatten(0, 1), truth.flatten(), reduction="none").view_as(truth)
    per_slot = settings.lilicorr_ce_weight * ce
    if settings.lilicorr_margin_weight and k > 1:
        true_score = node.gather(-1, truth[..., None])[..., 0]
        best_other = node.masked_fill(hits & found[..., None], float("-inf")).max(dim=-1).values
        per_slot = per_slot + settings.lilicorr_margin_weight * F.relu(
            settings.lilicorr_margin - true_score + best_other
        )
    if settings.lilicorr_penalty_weight:
        if inputs.soft_ids is None:
            raise ValueError("the LiLiCorr penalty reads the target's scores: pass --target_topk K")
        target = _target_scores(inputs, blocks, ids)
        below = F.relu(
            target.gather(-1, truth[..., None]) - target
        )  # how far each candidate is below the truth
        per_slot = per_slot + settings.lilicorr_penalty_weight * (node.softmax(dim=-1) * below).sum(dim=-1)
    counted = weights * forced
    lattice_sum = (per_slot * counted).sum()
    rows.loss_sum = rows.loss_sum + lattice_sum
    choice = node.argmax(dim=-1)
    walked = choice == truth
    correct = rows.correct.clone()
    correct[slots[forced]] = walked[forced]
    correct[slots[~forced]] = False  # the walk cannot reach a true token after a slot that lacked one
    return loss_terms(
        inputs,
        rows,
        correct,
        selector_loss_sum=lattice_sum.detach(),
        selector_rows=found.new_tensor(slots.numel(), dtype=torch.float32),  # what recall and unary count
        candidate_hits=found.sum().float(),
        unary_correct=rows.correct[slots].sum().float(),
        reranked=(choice != 0).sum().float(),
    )
