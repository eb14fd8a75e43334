"""The DFlash training loss: the weighted, chunked LM-head loss of the drafter's block positions, and the
sums that logging and global normalisation add up (`LossTerms`).

Full-vocabulary logits for every block position never exist at once (`chunked_weighted_ce`); the weights
come with the block inputs (blocks.py) or, for D-PACE and AUF, from the rows' own CE and argmax
(weighting.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_ddp.drafter.blocks import BlockInputs
from dflash_ddp.drafter.distillation import logit_gradients, row_losses
from dflash_ddp.drafter.weighting import LossSettings, reweighting


class _ChunkedLMHeadCE(torch.autograd.Function):
    """Weighted per-row loss through the LM head, `chunk` rows at a time, recomputed in backward.

    Full-vocabulary logits for all block positions never exist at once: the peak is chunk x vocab. The
    row loss is the hard label's CE or a loss against soft targets (distillation.py). Returns the weighted
    loss sum and, without gradient, whether each row's argmax equals its label.
    """

    @staticmethod
    def forward(ctx, hidden, head_weight, labels, weights, soft, settings, reweight):
        chunk, loss, ce_weight = settings.chunk_rows, settings.loss, settings.ce_weight
        soft_ids, soft_probs = soft if soft is not None else (None, None)
        correct = torch.empty(hidden.shape[0], dtype=torch.bool, device=hidden.device)
        nlls, row_loss = [], []
        for start in range(0, hidden.shape[0], chunk):
            rows = slice(start, start + chunk)
            # In the head's dtype (bf16 on GPU): casting the chunk is cheap, casting the V x H head is not.
            logits = (hidden[rows].to(head_weight.dtype) @ head_weight.T).float()
            nll, loss_rows = row_losses(
                logits, labels[rows], _rows(soft_ids, rows), _rows(soft_probs, rows), loss, ce_weight
            )
            nlls.append(nll)
            row_loss.append(loss_rows)
            correct[rows] = logits.argmax(dim=-1) == labels[rows]
        if reweight is not None:  # weights from the rows' own label CE and argmax: constants for backward
            weights = reweight(torch.cat(nlls), correct)
        loss_sum = hidden.new_zeros((), dtype=torch.float32)
        for i, loss_rows in enumerate(row_loss):
            loss_sum += (loss_rows * weights[i * chunk : (i + 1) * chunk]).sum()
        ctx.save_for_backward(hidden, head_weight, labels, weights, soft_ids, soft_probs)
        ctx.chunk, ctx.loss, ctx.ce_weight = chunk, loss, ce_weight
        ctx.mark_non_differentiable(correct)
        return loss_sum, correct

    @staticmethod
    def backward(ctx, grad_loss, _grad_correct):
        hidden, head_weight, labels, weights, soft_ids, soft_probs = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden)
        for start in range(0, hidden.shape[0], ctx.chunk):
            rows = slice(start, start + ctx.chunk)
            h = hidden[rows].to(head_weight.dtype)
            grad_logits = logit_gradients(
                (h @ head_weight.T).float(),
                labels[rows],
                _rows(soft_ids, rows),
                _rows(soft_probs, rows),
                ctx.loss,
                ctx.ce_weight,
            )
            scale = (weights[rows] * grad_loss)[:, None]
            grad_hidden[rows] = ((grad_logits * scale).to(h.dtype) @ head_weight).to(hidden.dtype)
        return grad_hidden, *([None] * 6)


def _rows(t: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
    return None if t is None else t[rows]


def chunked_weighted_ce(
    hidden: torch.Tensor,
    head_weight: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    settings: LossSettings = LossSettings(),  # noqa: B008 - frozen: one shared default is safe
    reweight=None,
    soft: tuple[torch.Tensor, torch.Tensor] | None = None,
):
    """(weighted loss sum, argmax-correct flags) of `hidden @ head_weight.T`, `settings.chunk_rows` rows at a
    time, against `labels` (`settings.loss` "ce"), or against the soft targets `soft` = (ids, probs) [rows, k]
    ("kl" or "tv", with `settings.ce_weight` of the hard label's CE mixed in). `reweight`, when given, maps
    the rows' detached label CE and argmax-correct flags to the weights used instead of `weights`."""
    return _ChunkedLMHeadCE.apply(hidden, head_weight, labels, weights, soft, settings, reweight)


@dataclass
class LossTerms:
    """Sums, not means, so that ranks and micro-batches can add them before normalising globally."""

    loss_sum: torch.Tensor  # differentiable
    weight_sum: torch.Tensor
    correct_per_pos: torch.Tensor  # [bs] correct predictions at block position k
    count_per_pos: torch.Tensor  # [bs] scored predictions at block position k
    accepted_sum: torch.Tensor  # sum over blocks of the estimated accepted length (bonus included)
    num_blocks: torch.Tensor

    @classmethod
    def zeros(cls, block_size: int, device: torch.device) -> LossTerms:
        """The sums of nothing: where a step's totals start."""
        return cls(*(torch.zeros(n, device=device) for n in ((), (), block_size, block_size, (), ())))

    def metrics(self) -> dict[str, float]:
        """Loss, accuracy and estimated tau from (possibly all-reduced) sums."""
        count = self.count_per_pos[1:].sum().clamp(min=1)
        per_pos = self.correct_per_pos[1:] / self.count_per_pos[1:].clamp(min=1)
        return {
            "loss": float(self.loss_sum.detach() / self.weight_sum.clamp(min=1e-12)),
            "accuracy": float(self.correct_per_pos[1:].sum() / count),
            "tau_estimate": float(self.accepted_sum / self.num_blocks.clamp(min=1)),
            "accuracy_per_position": [round(float(x), 4) for x in per_pos],
        }


def block_loss_terms(
    last_hidden: torch.Tensor,
    head_weight: torch.Tensor,
    inputs: BlockInputs,
    settings: LossSettings = LossSettings(),  # noqa: B008 - frozen: one shared default is safe
) -> LossTerms:
    """Loss sums and metric counts for the drafter's output `last_hidden` [B, A*bs, H] (kl and tv read the
    inputs' soft targets)."""
    weights = inputs.weights
    scored = weights > 0
    flat_idx = inputs.scored
    hidden = last_hidden.reshape(-1, last_hidden.shape[-1]).index_select(0, flat_idx)
    num_blocks = weights.shape[0] * weights.shape[1]
    reweight = reweighting(settings, flat_idx, num_blocks, inputs.block_size)
    if settings.loss != "ce" and inputs.soft_ids is None:
        raise ValueError(f"loss {settings.loss} needs the target's soft targets (--target_topk)")
    soft = None
    if settings.loss != "ce":
        soft = tuple(t.flatten(0, 2)[flat_idx] for t in (inputs.soft_ids, inputs.soft_probs))
    loss_sum, correct_rows = chunked_weighted_ce(
        hidden,
        head_weight,
        inputs.labels.flatten()[flat_idx],
        weights.flatten()[flat_idx],
        settings,
        reweight,
        soft,
    )
    correct = torch.zeros(scored.numel(), dtype=torch.bool, device=weights.device)
    correct[flat_idx] = correct_rows
    correct = correct.view_as(scored)
    # Estimated acceptance: the anchor's bonus token plus the prefix of correct, scored positions.
    prefix = torch.cumprod(correct[:, :, 1:].long(), dim=-1).sum(-1)
    blocks = inputs.anchors >= 0
    return LossTerms(
        loss_sum=loss_sum,
        weight_sum=inputs.weight_sum.detach(),
        correct_per_pos=correct.sum(dim=(0, 1)).float(),
        count_per_pos=scored.sum(dim=(0, 1)).float(),
        accepted_sum=((1 + prefix) * blocks).sum().float(),
        num_blocks=blocks.sum().float(),
    )
