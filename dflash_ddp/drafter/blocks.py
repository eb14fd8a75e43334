"""The drafter's training blocks: where anchors sit, how a batch's blocks are chunked, and the block inputs.

For a sequence of length S with A sampled anchors, the drafter sees A blocks of `block_size` tokens
`[token at anchor, MASK, ..., MASK]` at positions anchor+0..anchor+block_size-1. Block position k >= 1
is scored against the token AT anchor+k (no extra shift), weighted by the response mask there and by a
position weight (weighting.py). A block sees the context features strictly before its anchor and its own
block (bidirectionally); blocks never see each other; padding blocks see nothing (attention.py, flex.py).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from dflash_ddp.data.batch import SoftTargets
from dflash_ddp.drafter.distillation import renormalised
from dflash_ddp.drafter.weighting import LossSettings, label_weights

ANCHOR_RULES = ("response", "prompt_end")


def _anchor_seed(seed: int, epoch: int, sample_id: int) -> int:
    digest = hashlib.blake2b(f"dflash-anchors:{seed}:{epoch}:{sample_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def anchor_count(num_anchors: int, length: int, scale_tokens: int) -> int:
    """Blocks drawn from a sequence of `length` tokens: `num_anchors`, or with `scale_tokens` > 0 and a longer
    sequence, `num_anchors` per `scale_tokens` tokens (rounded up), so that long sequences train as many blocks
    per token as sequences of `scale_tokens` do."""
    if scale_tokens <= 0 or length <= scale_tokens:
        return num_anchors
    return -(-num_anchors * length // scale_tokens)


def sample_anchors(
    loss_mask: torch.Tensor,
    num_anchors: int,
    seed: int,
    epoch: int,
    sample_id: int,
    rule: str = "response",
    scale_tokens: int = 0,
) -> torch.Tensor:
    """Sorted anchor positions for one sequence: a pure function of (seed, epoch, sample id) and its mask.

    Candidates (`rule` "response") are positions a where the anchor token a and the next token a+1 are both
    response tokens. At inference the first block's anchor is the target's first generated token, so an
    anchor on the last prompt token (the generation prompt's end) would train a case that never occurs;
    SpecForge's trainer applies the same rule. `rule` "prompt_end" also allows that position (every a whose
    next token is a response token), to measure what the rule is worth. At most `anchor_count` anchors are
    drawn uniformly without replacement.
    """
    loss_mask = loss_mask.bool().cpu()
    allowed = loss_mask[1:] if rule == "prompt_end" else loss_mask[:-1] & loss_mask[1:]
    candidates = torch.nonzero(allowed, as_tuple=False).flatten()
    count = min(anchor_count(num_anchors, loss_mask.numel(), scale_tokens), candidates.numel())
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
    reweighted: bool = False  # `weights` only mark the labelled positions; the loss sets them (D-PACE, AUF)
    soft_ids: torch.Tensor | None = None  # [B, A, bs, k] the target's top-k tokens for each label's position
    soft_probs: torch.Tensor | None = None  # [B, A, bs, k] their probabilities, renormalised (fp32)

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
    settings: LossSettings = LossSettings(),  # noqa: B008 - frozen: one shared default is safe
    min_slots: int = 1,
    soft: SoftTargets | None = None,
) -> BlockInputs:
    """Assemble block tokens, positions, labels and weights from per-sequence anchor lists, with at least
    `min_slots` anchor slots (padding blocks, anchor -1, weight 0). The weights are `settings`' decay, or,
    for D-PACE and AUF, mark the labelled positions (1) and the loss sets their values. With
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
    weights = label_weights(block_size, settings).to(device) * response * in_seq
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
        reweighted=settings.reweighted,
        soft_ids=soft_ids,
        soft_probs=soft_probs,
    )
