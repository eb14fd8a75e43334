"""DFlash2's candidate selector: how a block's positions stop being drafted independently of each other.

After the drafter's final norm, each drafted position l (1 .. bs-1) takes the target LM head's K best tokens
as candidates, their logits (times `output_multiplier`, soft-capped by `final_logit_softcapping`) as unary
scores, and adds a pairwise score with the token chosen before it:

    score[l, c] = unary[l, c] + < A[previous] * (W h_l), B[candidate c] >

with the predecessor and successor codebooks A and B ([V, r], over the whole target vocabulary) and the
hidden projection W ([r, H]). The predecessor of position 1 is the anchor (the token the block starts
from). Serving walks the block greedily (`walk`); training teacher-forces the predecessor to the data's
previous token (`selector_terms`), which is exactly the walk for as long as every earlier draft was right:
so the accuracy and the estimated tau of a DFlash2 drafter are the selector's.

A label that is not among the K candidates gives the selector nothing to learn at that position (the walk
could not draft it whatever the scores): its selector loss is left out, as SpecForge does, and the position
counts as wrong.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from dflash_ddp.drafter.blocks import BlockInputs
from dflash_ddp.drafter.objective import (
    LossTerms,
    ScoredRows,
    as_target_logits,
    best_first,
    loss_terms,
    scored_rows,
)
from dflash_ddp.drafter.weighting import LossSettings


class CandidateSelector(nn.Module):
    """The pairwise scores of a position's candidates given the token before them (module docstring).

    The codebooks are bare parameters (the engines load `candidate_selector.predecessor_codebook`, no
    `.weight`); they are lookup tables, so the optimizer keeps them on AdamW."""

    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))

    def reset_parameters(self, std: float) -> None:
        """SpecForge's start: the successor codebook zero, so every pairwise score is 0 and the selector picks
        the LM head's own best token (an untrained DFlash2 drafts as DFlash); the rest random, so that the
        successor codebook's gradient is not zero (with W or A zero too, nothing would ever move)."""
        nn.init.normal_(self.hidden_projection.weight, std=std)
        nn.init.normal_(self.predecessor_codebook, std=std)
        nn.init.zeros_(self.successor_codebook)

    def scores(
        self, hidden: torch.Tensor, unary: torch.Tensor, candidates: torch.Tensor, previous: torch.Tensor
    ) -> torch.Tensor:
        """[N, K] scores of `candidates` [N, K] (with unary scores `unary` [N, K]) for positions whose output is
        `hidden` [N, H] and whose previous token is `previous` [N]."""
        query = self.predecessor_codebook[previous] * self.hidden_projection(hidden)  # [N, r]
        pairwise = torch.einsum("nr,nkr->nk", query, self.successor_codebook[candidates])
        return unary.float() + pairwise.float()


def unary_scores(logits: torch.Tensor, multiplier: float, softcap: float | None) -> torch.Tensor:
    """The candidates' LM-head logits as the engines score them: times the multiplier, then soft-capped."""
    return as_target_logits(logits, multiplier, softcap)


@torch.no_grad()
def walk(
    selector: CandidateSelector,
    hidden: torch.Tensor,
    head: nn.Module,
    anchor: torch.Tensor,
    multiplier: float = 1.0,
    softcap: float | None = None,
) -> torch.Tensor:
    """The greedy walk over a block's candidates: [1, bs-1] drafted tokens from the block's final-normed
    output `hidden` [1, bs, H], the target's LM head `head` and the anchor token [1, 1]. Each position takes
    the first best of its candidates given the token chosen before it (the anchor for the first)."""
    drafted = hidden[:, 1:]
    logits = head(drafted.to(head.weight.dtype))
    values, candidates = best_first(logits, selector.top_k)
    unary = unary_scores(values, multiplier, softcap)
    previous, tokens = anchor[:, 0], []
    for slot in range(drafted.shape[1]):
        scores = selector.scores(drafted[:, slot], unary[:, slot], candidates[:, slot], previous)
        previous = candidates[:, slot].gather(-1, scores.argmax(dim=-1, keepdim=True))[:, 0]
        tokens.append(previous)
    return torch.stack(tokens, dim=1)


def _chunk_loss(selector, hidden, head_weight, candidates, previous, target, weights, transform):
    """One chunk of rows: the weighted K-way CE of the selector's scores and its pick's place among the
    candidates (`transform`: the unary scores' multiplier and soft cap)."""
    candidate_logits = torch.einsum("nh,nkh->nk", hidden.to(head_weight.dtype), head_weight[candidates])
    scores = selector.scores(hidden, unary_scores(candidate_logits, *transform), candidates, previous)
    ce = F.cross_entropy(scores, target, reduction="none")
    return (ce * weights).sum(), scores.argmax(dim=-1)


def selector_terms(
    drafter: nn.Module,
    last_hidden: torch.Tensor,
    head_weight: torch.Tensor,
    inputs: BlockInputs,
    settings: LossSettings,
) -> LossTerms:
    """DFlash2's loss sums for one chunk: the LM-head loss of every scored position (as DFlash's) plus
    `settings.selector_weight` times the selector's K-way cross-entropy over the LM head's top K, with the
    previous token teacher-forced and the same position weights; accuracy and tau are the selector's."""
    config, selector = drafter.config, drafter.candidate_selector
    rows: ScoredRows = scored_rows(last_hidden, head_weight, inputs, settings, top_k=selector.top_k)
    # the token before position l of a block is the label of position l - 1 (the anchor for l = 1)
    previous = inputs.labels.flatten()[rows.index - 1]
    hits = rows.candidates == rows.labels[:, None]
    found = hits.any(dim=-1)
    target = hits.float().argmax(dim=-1)  # the label's rank among the candidates (0 where not found)
    weights = rows.weights * found
    selector_sum = rows.hidden.new_zeros((), dtype=torch.float32)
    picked = torch.zeros_like(target)  # the selector's choice: a place among the candidates
    step = settings.chunk_rows
    for start in range(0, rows.hidden.shape[0], step):
        part = slice(start, start + step)
        # recomputed in backward: the gathered head rows [chunk, K, H] are never kept
        chunk_sum, chunk_picked = checkpoint(
            _chunk_loss,
            selector,
            rows.hidden[part],
            head_weight,
            rows.candidates[part],
            previous[part],
            target[part],
            weights[part],
            (config.output_multiplier, config.final_logit_softcapping),
            use_reentrant=False,
            preserve_rng_state=False,  # nothing in it is random
        )
        selector_sum = selector_sum + chunk_sum
        picked[part] = chunk_picked
    rows.loss_sum = rows.loss_sum + settings.selector_weight * selector_sum
    count = torch.tensor(float(found.numel()), device=found.device)
    return loss_terms(
        inputs,
        rows,
        (picked == target) & found,
        selector_loss_sum=selector_sum.detach(),
        selector_rows=count,
        candidate_hits=found.sum().float(),
        unary_correct=rows.correct.sum().float(),
        reranked=(picked != 0).sum().float(),
    )
