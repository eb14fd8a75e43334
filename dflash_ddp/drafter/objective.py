"""The DFlash training objective: anchors, block inputs, the attention rule, the weighted loss, metrics.

For a sequence of length S with A sampled anchors, the drafter sees A blocks of `block_size` tokens
`[token at anchor, MASK, ..., MASK]` at positions anchor+0..anchor+block_size-1. Block position k >= 1
is scored against the token AT anchor+k (no extra shift), weighted by the response mask there and by a
position weight: the paper's fixed decay exp(-(k-1)/gamma) normalised by the weights' sum ("decay"),
D-PACE's weights from the drafter's own confidence ("dpace", `dpace_weights`), or Spec-AUF's support up to
the drafter's first wrong prediction ("auf", `until_fail_weights`), the last two normalised by the number of
blocks with a label. A block sees the context features strictly before its anchor and its own block
(bidirectionally); blocks never see each other; padding blocks see nothing.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from dflash_ddp.data.batch import SoftTargets
from dflash_ddp.drafter.distillation import logit_gradients, renormalised, row_losses

POSITION_WEIGHTINGS = ("decay", "dpace", "auf")
ANCHOR_RULES = ("response", "prompt_end")

# The paper's decay constants (appendix A.1); other block sizes interpolate (bs + 5) / 3, which hits all three.
_PAPER_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def loss_gamma(block_size: int) -> float:
    """gamma of the position-decay weights for a block size (7 for 16, 5 for 10, 4 for 8)."""
    return _PAPER_GAMMA.get(block_size, (block_size + 5) / 3)


def scheduled_gamma(start: float, end: float, step: int, total_steps: int) -> float:
    """The decay constant at optimizer step `step` (0-based) of `total_steps`: `start` at the first step,
    moving linearly to `end` at the last."""
    return start + (end - start) * min(step, total_steps - 1) / max(1, total_steps - 1)


def position_weights(block_size: int, gamma: float | None = None) -> torch.Tensor:
    """[block_size] weights: 0 at the anchor, exp(-(k-1)/gamma) at block position k >= 1."""
    gamma = loss_gamma(block_size) if gamma is None else gamma
    k = torch.arange(block_size, dtype=torch.float32)
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w


def dpace_weights(
    nll: torch.Tensor, scored: torch.Tensor, num_blocks: int, block_size: int, smoothing: float
):
    """D-PACE position weights (Dynamic Position-Aware Cross-Entropy) of the scored rows, detached.

    `nll` holds the cross-entropy of each scored row, `scored` their flat indices into [blocks, block_size].
    With q_k = exp(-CE_k) the drafter's probability of the label at block position k and the smoothed
    q~_k = (1 - a) q_k + a, position j weighs sum over m >= j of prod_{i <= m} q~_i: the derivative of the
    expected accepted length with respect to log q_j. A position without a label (past the response) has
    q~ = 0, so the chain of a block ends there, as acceptance would."""
    q = torch.zeros(num_blocks * block_size, dtype=torch.float32, device=nll.device)
    q[scored] = (1.0 - smoothing) * torch.exp(-nll.detach().float()) + smoothing
    prefix = torch.cumprod(q.view(num_blocks, block_size)[:, 1:], dim=1)  # P_m, m = 1..bs-1
    weights = torch.zeros(num_blocks, block_size, dtype=torch.float32, device=nll.device)
    weights[:, 1:] = prefix.flip(1).cumsum(1).flip(1)  # sum over m >= j of P_m
    return weights.flatten()[scored]


def until_fail_weights(correct: torch.Tensor, scored: torch.Tensor, num_blocks: int, block_size: int):
    """Spec-AUF (accept until fail) weights of the scored rows: 1 up to and including a block's first
    position whose argmax misses its label, 0 after it, as if decoding stopped there.

    `correct` holds whether each scored row's argmax is its label, `scored` their flat indices into
    [blocks, block_size]; a position without a label ends the block's chain, as acceptance would. The
    weights come from argmaxes, so no gradient can flow through them."""
    hit = torch.zeros(num_blocks * block_size, dtype=torch.float32, device=correct.device)
    hit[scored] = correct.float()
    all_right = torch.cumprod(hit.view(num_blocks, block_size)[:, 1:], dim=1)  # positions 1..m all right
    weights = torch.zeros(num_blocks, block_size, dtype=torch.float32, device=correct.device)
    weights[:, 1] = 1.0
    weights[:, 2:] = all_right[:, :-1]  # position j counts when 1..j-1 were right
    return weights.flatten()[scored]


def _anchor_seed(seed: int, epoch: int, sample_id: int) -> int:
    digest = hashlib.blake2b(f"dflash-anchors:{seed}:{epoch}:{sample_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def sample_anchors(
    loss_mask: torch.Tensor,
    num_anchors: int,
    seed: int,
    epoch: int,
    sample_id: int,
    rule: str = "response",
) -> torch.Tensor:
    """Sorted anchor positions for one sequence: a pure function of (seed, epoch, sample id) and its mask.

    Candidates (`rule` "response") are positions a where the anchor token a and the next token a+1 are both
    response tokens. At inference the first block's anchor is the target's first generated token, so an
    anchor on the last prompt token (the generation prompt's end) would train a case that never occurs;
    SpecForge's trainer applies the same rule. `rule` "prompt_end" also allows that position (every a whose
    next token is a response token), to measure what the rule is worth. At most `num_anchors` are drawn
    uniformly without replacement.
    """
    loss_mask = loss_mask.bool().cpu()
    allowed = loss_mask[1:] if rule == "prompt_end" else loss_mask[:-1] & loss_mask[1:]
    candidates = torch.nonzero(allowed, as_tuple=False).flatten()
    count = min(num_anchors, candidates.numel())
    gen = torch.Generator().manual_seed(_anchor_seed(seed, epoch, sample_id))
    chosen = candidates[torch.randperm(candidates.numel(), generator=gen)[:count]]
    return chosen.sort().values


def plan_draft_chunks(
    anchors: list[torch.Tensor], lengths: list[int], block_size: int, chunk_tokens: int
) -> list[list[tuple[int, torch.Tensor]]]:
    """Split a batch's draft blocks into chunks that the drafter processes one forward/backward at a time.

    A chunk is a list of (row, anchors) pieces; padded to its widest piece and longest row it holds at most
    `chunk_tokens` draft positions (rows x anchors x block_size) and context tokens (rows x length), so its
    memory does not grow with the number of sequences per batch. A sequence with more blocks than a chunk
    holds is split into pieces; each piece sees the same context, so the result changes only by the order
    of floating-point sums. Rows without anchors are left out (they carry no loss)."""
    per_chunk = max(1, chunk_tokens // block_size)
    chunks: list[list[tuple[int, torch.Tensor]]] = []
    current: list[tuple[int, torch.Tensor]] = []
    for row, row_anchors in enumerate(anchors):
        for start in range(0, row_anchors.numel(), per_chunk):
            piece = (row, row_anchors[start : start + per_chunk])
            grown = current + [piece]
            widest = max(p.numel() for _, p in grown)
            longest = max(lengths[r] for r, _ in grown)
            if current and len(grown) * max(widest * block_size, longest) > chunk_tokens:
                chunks.append(current)
                grown = [piece]
            current = grown
    if current:
        chunks.append(current)
    return chunks


@dataclass
class BlockInputs:
    """Everything one drafter forward/loss needs for a padded batch of B sequences with A anchor slots."""

    block_ids: torch.Tensor  # [B, A*bs] token ids: anchor token then mask ids
    position_ids: torch.Tensor  # [B, S + A*bs] context positions, then block positions
    labels: torch.Tensor  # [B, A, bs] token at anchor+k (0 where undefined)
    weights: torch.Tensor  # [B, A, bs] loss weights (0 at k=0, outside the response, padding)
    anchors: torch.Tensor  # [B, A] anchor positions, -1 for padding slots
    scored: torch.Tensor  # flat indices into [B*A*bs] of the positions with a positive weight
    context_len: int  # S
    block_size: int
    dpace_smoothing: float | None = None  # D-PACE's a; None: the fixed decay of `weights` (or AUF)
    until_fail: bool = False  # Spec-AUF's weights instead of the fixed decay
    soft_ids: torch.Tensor | None = None  # [B, A, bs, k] the target's top-k tokens for each label's position
    soft_probs: torch.Tensor | None = None  # [B, A, bs, k] their probabilities, renormalised (fp32)

    @property
    def reweighted(self) -> bool:
        """Whether the loss sets the weights from the drafter's own outputs (D-PACE, AUF), `weights` only
        marking the labelled positions, rather than using the fixed decay of `weights`."""
        return self.dpace_smoothing is not None or self.until_fail

    @property
    def weight_sum(self) -> torch.Tensor:
        """What the loss sum is divided by (summed over every chunk, micro-batch and drafter rank first):
        the position weights' sum for the decay, the number of blocks with a label for D-PACE and AUF."""
        if not self.reweighted:
            return self.weights.sum()
        return (self.weights.sum(-1) > 0).sum().float()

    def to(self, device: torch.device) -> BlockInputs:
        """A copy on `device`; built on the host, the copies do not wait for the device."""
        if device.type == "cuda":
            move = lambda t: t.pin_memory().to(device, non_blocking=True)  # noqa: E731
        else:
            move = lambda t: t.to(device)  # noqa: E731
        tensors = {
            k: v if v.device == device else move(v)  # soft targets received on the device stay there
            for k, v in vars(self).items()
            if isinstance(v, torch.Tensor)
        }
        return BlockInputs(**{**vars(self), **tensors})


def build_block_inputs(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: list[torch.Tensor],
    block_size: int,
    mask_token_id: int,
    gamma: float | None = None,
    min_slots: int = 1,
    dpace_smoothing: float | None = None,
    soft: SoftTargets | None = None,
    until_fail: bool = False,
) -> BlockInputs:
    """Assemble block tokens, positions, labels and weights from per-sequence anchor lists, with at least
    `min_slots` anchor slots (padding blocks, anchor -1, weight 0). With `dpace_smoothing` (or `until_fail`)
    the weights mark the labelled positions (1) and D-PACE (or AUF) sets their values in the loss. With
    `soft` ([B, S, k], the target's top-k at each position) each label at anchor+k gets the target's
    distribution computed at anchor+k-1, the position that predicts it."""
    batch, seq_len = input_ids.shape
    device = input_ids.device
    num_slots = max(min_slots, max(a.numel() for a in anchors))
    anchor_t = torch.full((batch, num_slots), -1, dtype=torch.long, device=device)
    for b, a in enumerate(anchors):
        anchor_t[b, : a.numel()] = a.to(device)
    valid_anchor = anchor_t >= 0
    offsets = torch.arange(block_size, device=device)
    pos = anchor_t.clamp(min=0)[:, :, None] + offsets  # [B, A, bs]
    in_seq = (pos < seq_len) & valid_anchor[:, :, None]
    gathered = torch.gather(input_ids, 1, pos.clamp(max=seq_len - 1).flatten(1)).view_as(pos)
    block_ids = torch.full_like(pos, mask_token_id)
    block_ids[:, :, 0] = torch.where(valid_anchor, gathered[:, :, 0], mask_token_id)
    labels = torch.where(in_seq, gathered, 0)
    response = torch.gather(loss_mask.float(), 1, pos.clamp(max=seq_len - 1).flatten(1)).view_as(pos)
    fixed = dpace_smoothing is None and not until_fail
    per_position = position_weights(block_size, gamma) if fixed else position_weights(block_size) > 0
    weights = per_position.float().to(device) * response * in_seq
    context_pos = torch.arange(seq_len, device=device).expand(batch, seq_len)
    soft_ids = soft_probs = None
    if soft is not None:  # gathered where the soft targets are (the drafter's GPU): no copy to the host
        on = soft.ids.device
        before = (pos - 1).clamp(min=0, max=seq_len - 1).flatten(1)[..., None].expand(-1, -1, soft.k)
        before = before.to(on, non_blocking=True)
        shape = (*pos.shape, soft.k)
        soft_ids = torch.gather(soft.ids, 1, before).view(shape).long()
        soft_probs = renormalised(torch.gather(soft.probs, 1, before).view(shape))
    return BlockInputs(
        block_ids=block_ids.flatten(1),
        position_ids=torch.cat([context_pos, pos.flatten(1)], dim=1),
        labels=labels,
        weights=weights,
        anchors=anchor_t,
        scored=torch.nonzero(weights.flatten() > 0, as_tuple=False).flatten(),
        context_len=seq_len,
        block_size=block_size,
        dpace_smoothing=dpace_smoothing,
        until_fail=until_fail,
        soft_ids=soft_ids,
        soft_probs=soft_probs,
    )


def dense_block_mask(anchors: torch.Tensor, context_len: int, block_size: int) -> torch.Tensor:
    """Boolean visibility [B, 1, A*bs, S + A*bs] for the SDPA path (True = may attend)."""
    device = anchors.device
    num_q = anchors.shape[1] * block_size
    q_block = torch.arange(num_q, device=device) // block_size
    q_anchor = anchors[:, q_block]  # [B, Q]
    valid = (q_anchor >= 0)[:, :, None]
    ctx = torch.arange(context_len, device=device)[None, None, :] < q_anchor[:, :, None]
    same_block = (q_block[:, None] == q_block[None, :])[None]
    mask = torch.cat([ctx, same_block.expand(anchors.shape[0], -1, -1)], dim=-1) & valid
    return mask[:, None]


class _ChunkedLMHeadCE(torch.autograd.Function):
    """Weighted per-row loss through the LM head, `chunk` rows at a time, recomputed in backward.

    Full-vocabulary logits for all block positions never exist at once: the peak is chunk x vocab. The
    row loss is the hard label's CE or a loss against soft targets (distillation.py). Returns the weighted
    loss sum and, without gradient, whether each row's argmax equals its label.
    """

    @staticmethod
    def forward(
        ctx, hidden, head_weight, labels, weights, chunk, reweight, soft_ids, soft_probs, loss, ce_weight
    ):
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
        return grad_hidden, *([None] * 9)


def _rows(t: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
    return None if t is None else t[rows]


def chunked_weighted_ce(
    hidden,
    head_weight,
    labels,
    weights,
    chunk: int = 1024,
    reweight=None,
    soft_ids=None,
    soft_probs=None,
    loss: str = "ce",
    ce_weight: float = 0.0,
):
    """(weighted loss sum, argmax-correct flags) of `hidden @ head_weight.T` against `labels` (`loss` "ce"),
    or against the soft targets `soft_ids`/`soft_probs` [rows, k] (`loss` "kl" or "tv", with `ce_weight` of
    the hard label's CE mixed in). `reweight`, when given, maps the rows' detached label CE and argmax-correct
    flags to the weights used instead of `weights`."""
    return _ChunkedLMHeadCE.apply(
        hidden, head_weight, labels, weights, chunk, reweight, soft_ids, soft_probs, loss, ce_weight
    )


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
    chunk: int,
    loss: str = "ce",
    ce_weight: float = 0.0,
) -> LossTerms:
    """Loss sums and metric counts for the drafter's output `last_hidden` [B, A*bs, H]; `loss` and
    `ce_weight` as in `chunked_weighted_ce` (kl and tv read the inputs' soft targets)."""
    weights = inputs.weights
    scored = weights > 0
    flat_idx = inputs.scored
    hidden = last_hidden.reshape(-1, last_hidden.shape[-1]).index_select(0, flat_idx)
    reweight = None
    num_blocks = weights.shape[0] * weights.shape[1]
    if inputs.dpace_smoothing is not None:

        def reweight(nll: torch.Tensor, correct: torch.Tensor) -> torch.Tensor:
            return dpace_weights(nll, flat_idx, num_blocks, inputs.block_size, inputs.dpace_smoothing)

    elif inputs.until_fail:

        def reweight(nll: torch.Tensor, correct: torch.Tensor) -> torch.Tensor:
            return until_fail_weights(correct, flat_idx, num_blocks, inputs.block_size)

    if loss != "ce" and inputs.soft_ids is None:
        raise ValueError(f"loss {loss} needs the target's soft targets (--target_topk)")
    soft = [None, None]
    if loss != "ce":
        soft = [t.flatten(0, 2)[flat_idx] for t in (inputs.soft_ids, inputs.soft_probs)]
    loss_sum, correct_rows = chunked_weighted_ce(
        hidden,
        head_weight,
        inputs.labels.flatten()[flat_idx],
        weights.flatten()[flat_idx],
        chunk,
        reweight,
        *soft,
        loss,
        ce_weight,
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
