"""How block positions weigh in the loss (--position_weighting), and the loss settings as one object.

Block position k >= 1 is scored against the token at anchor+k. Its weight is the paper's fixed decay
exp(-(k-1)/gamma), normalised by the weights' sum ("decay"), D-PACE's weights from the drafter's own
confidence ("dpace", `dpace_weights`), or Spec-AUF's support up to the drafter's first wrong prediction
("auf", `until_fail_weights`); the last two are computed in the loss from its own rows and normalised by the
number of blocks with a label.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# rows of an LM-head loss piece where the loss runs in pieces: on the CPU, or where memory requires (plan.py)
LOSS_PIECE_ROWS = 1024


@dataclass(frozen=True)
class LossSettings:
    """What the loss scores against and how it weighs block positions (--loss, --ce_weight,
    --position_weighting, --loss_gamma, --dpace_smoothing, --loss_chunk_size, --selector_loss_alpha,
    DSpark's --dspark_ce_alpha, --dspark_l1_alpha, --confidence_alpha, and LiLiCorr's --lilicorr_ce_alpha,
    --lilicorr_margin_alpha, --lilicorr_margin, --lilicorr_penalty_alpha)."""

    weighting: str = "decay"  # decay | dpace | auf
    gamma: float | None = None  # the decay's constant; None: the paper's for the block size
    dpace_smoothing: float = 0.5  # D-PACE's a
    loss: str = "ce"  # ce | kl | tv (see distillation.py); kl and tv read the target's soft targets
    ce_weight: float = 0.0  # the hard label's CE mixed into kl or tv
    chunk_rows: int = LOSS_PIECE_ROWS  # rows of the LM-head loss computed at once
    selector_weight: float = 1.0  # the candidate selector's loss beside the LM head's (DFlash2, selector.py)
    # DSpark's terms (dspark.py): CE of the Markov-biased logits, their L1 distance to the target's
    # distribution, and the confidence head's BCE (the reference's 0.1 / 0.9 / 1.0)
    soft_targets: bool = False  # the target sends its top-k distribution (--target_topk): kl, tv, DSpark
    dspark_ce_alpha: float = 0.1
    dspark_l1_alpha: float = 0.9
    confidence_alpha: float = 1.0
    # LiLiCorr's correlator terms (lilicorr.py): its CE, the hinge on the true candidate's margin and the
    # penalty on candidates the target scores below the truth (Model-Optimizer's 0.25 / 0 (margin 2) / 0.25)
    lilicorr_ce_weight: float = 0.25
    lilicorr_margin_weight: float = 0.0
    lilicorr_margin: float = 2.0
    lilicorr_penalty_weight: float = 0.25
    logit_scale: float = 1.0  # the target's multiplier of its logits (Falcon-H1's lm_head_multiplier)
    logit_softcap: float | None = None  # the target's final soft-capping of its logits (Gemma), else None
    # torch.compile's backend for the loss's per-chunk work (on CUDA "inductor": the passes over each chunk's
    # [rows, vocabulary] logits fuse into a few kernels); None: eager (the CPU)
    compile_backend: str | None = None

    @property
    def reweighted(self) -> bool:
        """Whether the loss sets the weights from the drafter's own outputs (D-PACE, AUF), the block
        inputs' weights only marking the labelled positions, rather than using the fixed decay."""
        return self.weighting in REWEIGHTINGS


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


def label_weights(block_size: int, settings: LossSettings) -> torch.Tensor:
    """[block_size] weights the block inputs carry: the decay's, or 1 at every scored position (0 at the
    anchor) where D-PACE or AUF set the values in the loss."""
    if settings.reweighted:
        return (position_weights(block_size) > 0).float()
    return position_weights(block_size, settings.gamma)


def reweighting(settings: LossSettings, scored: torch.Tensor, num_blocks: int, block_size: int):
    """The map from the scored rows' detached label CE and argmax-correct flags to their weights (D-PACE,
    AUF), or None for the fixed decay; `scored` are the rows' flat indices into [blocks, block_size]."""
    if not settings.reweighted:
        return None
    return REWEIGHTINGS[settings.weighting](settings, scored, num_blocks, block_size)


# the weightings computed in the loss from its own rows: (settings, scored, blocks, block size) -> the map
# from (nll, correct) to the rows' weights
REWEIGHTINGS = {
    "dpace": lambda settings, scored, blocks, size: (
        lambda nll, correct: dpace_weights(nll, scored, blocks, size, settings.dpace_smoothing)
    ),
    "auf": lambda settings, scored, blocks, size: (
        lambda nll, correct: until_fail_weights(correct, scored, blocks, size)
    ),
}
POSITION_WEIGHTINGS = ("decay", *REWEIGHTINGS)
