"""The DFlash training loss: the weighted, chunked LM-head loss of the drafter's block positions, and the
sums that logging and global normalisation add up (`LossTerms`).

Full-vocabulary logits for every block position never exist at once, and each chunk's are computed once: the
gradient is taken with the loss (`_FusedLMHeadLoss`, a fused linear cross-entropy, behind `scored_rows`). The weights come with
the block inputs (blocks.py) or, for D-PACE and AUF, from the rows' own CE and argmax (weighting.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields
from typing import NamedTuple

import torch
import torch.nn.functional as F

from dflash_ddp.drafter.blocks import BlockInputs
from dflash_ddp.drafter.distillation import logit_gradients, row_losses
from dflash_ddp.drafter.weighting import LossSettings, reweighting


def best_first(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `k` highest logits and their token ids along the last dimension, highest first and, among equal
    logits, lowest id first: the first candidate is then the LM head's argmax, so that with a zero pairwise
    score the selector drafts exactly DFlash's token (topk orders ties as it likes; bf16 logits tie often)."""
    values, ids = logits.topk(k, dim=-1)
    by_id = ids.argsort(dim=-1)
    values, ids = values.gather(-1, by_id), ids.gather(-1, by_id)
    order = values.sort(dim=-1, descending=True, stable=True).indices
    return values.gather(-1, order), ids.gather(-1, order)


def as_target_logits(logits: torch.Tensor, scale: float = 1.0, softcap: float | None = None) -> torch.Tensor:
    """LM-head logits in fp32 as the target (and the engines) finish them: times `scale`, then soft-capped
    (cap * tanh(logits / cap)) where it caps them."""
    logits = logits.float()
    if scale != 1.0:
        logits = logits * scale
    return torch.tanh(logits / softcap) * softcap if softcap else logits


def head_logits(
    hidden: torch.Tensor, head_weight: torch.Tensor, scale: float = 1.0, softcap: float | None = None
) -> torch.Tensor:
    """fp32 logits of `hidden` through the LM head as the target computes its own (`as_target_logits`). The
    product runs in the head's dtype (bf16 on GPU): casting the rows is cheap, casting the head is not."""
    return as_target_logits(hidden.to(head_weight.dtype) @ head_weight.T, scale, softcap)


class _FusedLMHeadLoss(torch.autograd.Function):
    """Weighted per-row loss through the frozen LM head, `chunk` rows at a time, with its gradient taken in
    the same pass (a fused linear cross-entropy).

    Full-vocabulary logits for all block positions never exist at once: the peak is chunk x vocab. The
    row loss is the hard label's CE or a loss against soft targets (distillation.py); its gradient with
    respect to the logits has a closed form there, so each chunk's logits are computed once: the forward
    also takes d(row loss)/d(hidden) through the head (which gets no gradient) and keeps it, [N, H] in the
    head's dtype, and backward only scales its rows by their weights and the incoming gradient.
    The weights multiply in backward because D-PACE and AUF know them only once every chunk is scored.
    Returns the weighted loss sum and, without gradient, whether each row's argmax equals its label, the
    weights used and each row's `top_k` highest-scoring tokens (best first; none when top_k is 0).

    With `log_probs` (LiLiCorr), the top-k tokens are chosen on the raw logits, as the engines choose a
    lattice's candidates, and their raw log-softmax [N, top_k] is a fifth, differentiable output: its
    gradient G reaches the rows as G @ W[candidates] - sum(G) * (softmax @ W), so the forward keeps each
    row's expected head row softmax @ W [N, H] (one more product per chunk) instead of the logits being
    formed again in backward.
    """

    @staticmethod
    def forward(ctx, hidden, head_weight, labels, weights, soft, scoring):
        """`scoring`: (the LossSettings, the reweighting map or None, how many best tokens to return,
        whether to take the gradient: `_with_grad`, whether to return their log-probabilities)."""
        settings, reweight, top_k, with_grad, log_probs = scoring
        chunk = settings.chunk_rows
        soft_ids, soft_probs = soft if soft is not None else (None, None)
        correct = torch.empty(hidden.shape[0], dtype=torch.bool, device=hidden.device)
        candidates = torch.empty(hidden.shape[0], top_k, dtype=torch.long, device=hidden.device)
        # the rows' gradient in the product's dtype, the head's (bf16 on CUDA, fp32 on the CPU)
        grad_rows = hidden.new_empty(hidden.shape, dtype=head_weight.dtype) if with_grad else None
        candidate_log_probs = hidden.new_empty(
            hidden.shape[0], top_k if log_probs else 0, dtype=torch.float32
        )
        expected_rows = grad_rows.new_empty(hidden.shape) if with_grad and log_probs else None
        score = _row_scorer(settings.compile_backend)
        how = _RowScoring(
            settings.logit_scale,
            settings.logit_softcap,
            settings.loss,
            settings.ce_weight,
            top_k,
            with_grad,
            log_probs,
        )
        nlls, row_loss = [], []
        for start in range(0, hidden.shape[0], chunk):
            rows = slice(start, start + chunk)
            soft_rows = (_rows(soft_ids, rows), _rows(soft_probs, rows))
            scored = score(hidden[rows], labels[rows], *soft_rows, head_weight, how)
            nlls.append(scored.nll)
            row_loss.append(scored.loss)
            correct[rows] = scored.correct
            if top_k:
                candidates[rows] = scored.candidates
            if with_grad:
                grad_rows[rows] = scored.grad
            if log_probs:
                candidate_log_probs[rows] = scored.log_probs
                if with_grad:
                    expected_rows[rows] = scored.expected
            del scored  # the chunk's temporaries go before the next chunk's exist
        if reweight is not None:  # weights from the rows' own label CE and argmax: constants for backward
            weights = reweight(torch.cat(nlls), correct)
        loss_sum = hidden.new_zeros((), dtype=torch.float32)
        for i, loss_rows in enumerate(row_loss):
            loss_sum += (loss_rows * weights[i * chunk : (i + 1) * chunk]).sum()
        ctx.save_for_backward(grad_rows, weights, expected_rows, candidates, head_weight)
        ctx.dtype = hidden.dtype
        ctx.mark_non_differentiable(correct, weights, candidates)
        return loss_sum, correct, weights, candidates, candidate_log_probs

    @staticmethod
    def backward(ctx, grad_loss, _correct, _weights, _candidates, grad_log_probs):
        grad_rows, weights, expected_rows, candidates, head_weight = ctx.saved_tensors
        grad = grad_rows * (weights * grad_loss)[:, None]
        if grad_log_probs is not None and expected_rows is not None:
            g = grad_log_probs.to(head_weight.dtype)
            picked = F.embedding_bag(candidates, head_weight, per_sample_weights=g, mode="sum")
            grad += picked - g.sum(dim=-1, keepdim=True) * expected_rows
        return grad.to(ctx.dtype), *([None] * 5)


class _RowScoring(NamedTuple):
    """How `_score_rows` scores a chunk: constants of the run and the call (a compiled scorer's graph is
    specialised on them)."""

    scale: float  # the target's logit scale
    cap: float | None  # the target's soft cap of its logits
    loss: str  # ce | kl | tv
    ce_weight: float  # the hard label's CE mixed into kl or tv
    top_k: int  # best tokens to return
    with_grad: bool  # take d(row loss)/d(hidden)
    log_probs: bool  # the candidates by raw logits with their log-softmax (LiLiCorr)


class _ChunkScores(NamedTuple):
    """One chunk's rows scored through the LM head (`_score_rows`)."""

    nll: torch.Tensor  # [R] the hard label's CE
    loss: torch.Tensor  # [R] the row loss (the CE, or the loss against the soft targets)
    correct: torch.Tensor  # [R] the argmax equals the label
    candidates: torch.Tensor | None  # [R, top_k] the best tokens, best first
    grad: torch.Tensor | None  # [R, H] d(row loss)/d(hidden) in the head's dtype
    log_probs: torch.Tensor | None  # [R, top_k] the candidates' raw log-softmax (LiLiCorr)
    expected: torch.Tensor | None  # [R, H] softmax @ W (LiLiCorr, with the gradient)


def _score_rows(hidden, labels, soft_ids, soft_probs, head_weight, how: _RowScoring) -> _ChunkScores:
    """One chunk of rows through the LM head, as `how` says. A function of its own so that the chunk's
    [rows, V] temporaries are gone before the next chunk's exist; the logits are finished and then overwritten
    in place once nothing else reads them. On CUDA it runs compiled (`LossSettings.compile_backend`): the
    passes over the logits fuse into a few kernels."""
    scale, cap, loss, ce_weight, top_k, with_grad, log_probs = how
    h = hidden.to(head_weight.dtype)
    logits = (h @ head_weight.T).float()  # as head_logits, finished in place: no [rows, V] temporaries
    candidates = lattice = expected = None
    if log_probs:  # before the logits are finished: the engines' candidates read the raw ones
        candidates, lattice, expected = _candidate_log_probs(logits, head_weight, top_k, with_grad)
    if scale != 1.0:
        logits.mul_(scale)
    if cap:
        logits.div_(cap).tanh_().mul_(cap)
    nll, loss_rows = row_losses(logits, labels, soft_ids, soft_probs, loss, ce_weight)
    correct = logits.argmax(dim=-1) == labels
    if top_k and not log_probs:
        candidates = best_first(logits, top_k)[1]
    grad_rows = None
    if with_grad:
        grad = logit_gradients(logits, labels, soft_ids, soft_probs, loss, ce_weight)
        if cap:  # d(cap * tanh(z / cap)) / dz = 1 - tanh(z / cap)^2, computed in the logits' place
            grad *= logits.div_(cap).square_().neg_().add_(1.0)
        del logits
        if scale != 1.0:
            grad *= scale
        grad_rows = grad.to(h.dtype) @ head_weight
    return _ChunkScores(nll, loss_rows, correct, candidates, grad_rows, lattice, expected)


def _candidate_log_probs(logits, head_weight, top_k: int, with_grad: bool):
    """The chunk's `top_k` best tokens by its raw `logits`, their log-softmax and, with the gradient, each
    row's expected head row softmax @ W (else None)."""
    log_partition = logits.logsumexp(dim=-1, keepdim=True)
    values, ids = best_first(logits, top_k)
    expected = None
    if with_grad:
        expected = logits.sub(log_partition).exp_().to(head_weight.dtype) @ head_weight
    return ids, values - log_partition, expected


@functools.cache
def _row_scorer(backend: str | None):
    """`_score_rows` as it is (None), or compiled with torch.compile's `backend`: one graph for every chunk
    of two rows or more, its rows marked dynamic (the last chunk is shorter, and each new count would compile
    another graph; a last chunk of one row compiles one more)."""
    if backend is None:
        return _score_rows
    compiled = torch.compile(_score_rows, backend=backend, fullgraph=True)

    def score(hidden, labels, soft_ids, soft_probs, head_weight, how):
        for t in (hidden, labels, soft_ids, soft_probs):
            if t is not None:
                torch._dynamo.maybe_mark_dynamic(t, 0)
        return compiled(hidden, labels, soft_ids, soft_probs, head_weight, how)

    return score


def _rows(t: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
    return None if t is None else t[rows]


def _with_grad(hidden: torch.Tensor) -> bool:
    """Whether the loss's gradient will be asked for (inside its forward a custom function cannot tell)."""
    return torch.is_grad_enabled() and hidden.requires_grad


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
    scoring = (settings, reweight, 0, _with_grad(hidden), False)
    loss_sum, correct, *_ = _FusedLMHeadLoss.apply(hidden, head_weight, labels, weights, soft, scoring)
    return loss_sum, correct


@dataclass
class LossTerms:
    """Sums, not means, so that ranks and micro-batches can add them before normalising globally."""

    loss_sum: torch.Tensor  # differentiable
    weight_sum: torch.Tensor
    correct_per_pos: torch.Tensor  # [bs] correct predictions at block position k
    count_per_pos: torch.Tensor  # [bs] scored predictions at block position k
    accepted_sum: torch.Tensor  # sum over blocks of the estimated accepted length (bonus included)
    num_blocks: torch.Tensor
    # a candidate selector's share (DFlash2's selector.py, LiLiCorr's correlator); zeros for a drafter without one
    selector_loss_sum: torch.Tensor  # detached: loss_sum already holds it, times its weight
    selector_rows: torch.Tensor  # scored positions the selector chose for
    candidate_hits: torch.Tensor  # of those, the ones whose label was among the candidates
    unary_correct: torch.Tensor  # of those, the ones whose LM-head argmax alone was right
    reranked: torch.Tensor  # of those, the ones where the selector chose other than the LM head's best
    # DSpark's share (dspark.py); zeros for another family
    dspark_rows: torch.Tensor  # scored positions
    distill_sum: torch.Tensor  # their L1 distance to the target's distribution, summed, detached
    predicted_acceptance_sum: torch.Tensor  # the confidence head's sigmoid, summed
    observed_acceptance_sum: torch.Tensor  # 1 - L1 / 2, what the confidence head learns, summed

    @classmethod
    def zeros(cls, block_size: int, device: torch.device) -> LossTerms:
        """The sums of nothing: where a step's totals start."""
        per_position = (block_size, block_size)  # correct_per_pos, count_per_pos; every other field a scalar
        shapes = ((), (), *per_position, *([()] * (len(fields(cls)) - 4)))
        return cls(*(torch.zeros(n, device=device) for n in shapes))

    def metrics(self) -> dict[str, float]:
        """Loss, accuracy and estimated tau from (possibly all-reduced) sums."""
        count = self.count_per_pos[1:].sum().clamp(min=1)
        per_pos = self.correct_per_pos[1:] / self.count_per_pos[1:].clamp(min=1)
        metrics = {
            "loss": float(self.loss_sum.detach() / self.weight_sum.clamp(min=1e-12)),
            "accuracy": float(self.correct_per_pos[1:].sum() / count),
            "tau_estimate": float(self.accepted_sum / self.num_blocks.clamp(min=1)),
            "accuracy_per_position": [round(float(x), 4) for x in per_pos],
        }
        if self.selector_rows > 0:  # accuracy and tau above are the selector's, as it drafts in serving
            rows = self.selector_rows
            metrics["selector_loss"] = float(self.selector_loss_sum / self.weight_sum.clamp(min=1e-12))
            metrics["unary_accuracy"] = float(self.unary_correct / rows)
            metrics["candidate_recall"] = float(self.candidate_hits / rows)
            # teacher-forced: how often the selector overrules the LM head (0 while it drafts as the head)
            metrics["rerank_share"] = float(self.reranked / rows)
        if self.dspark_rows > 0:  # accuracy and tau above are the Markov-biased logits'
            rows = self.dspark_rows
            metrics["distill_l1"] = float(self.distill_sum / rows)
            metrics["predicted_acceptance"] = float(self.predicted_acceptance_sum / rows)
            metrics["observed_acceptance"] = float(self.observed_acceptance_sum / rows)
        return metrics


@dataclass
class ScoredRows:
    """The scored block positions of a chunk, flattened, with the LM-head loss over them."""

    hidden: torch.Tensor  # [N, H] the drafter's outputs at those positions
    index: torch.Tensor  # [N] their flat indices into [B * A * bs] (inputs.scored)
    labels: torch.Tensor  # [N]
    weights: torch.Tensor  # [N] as the loss weighed them (D-PACE and AUF set them from the rows)
    correct: torch.Tensor  # [N] the LM head's argmax equals the label
    candidates: torch.Tensor  # [N, top_k] the LM head's best tokens, best first
    loss_sum: torch.Tensor  # differentiable
    candidate_log_probs: torch.Tensor | None = None  # [N, top_k] differentiable, where asked for (LiLiCorr)


def scored_rows(
    last_hidden: torch.Tensor,
    head_weight: torch.Tensor,
    inputs: BlockInputs,
    settings: LossSettings,
    top_k: int = 0,
    log_probs: bool = False,
) -> ScoredRows:
    """The LM-head loss of the drafter's output `last_hidden` [B, A*bs, H] at the scored positions (kl and tv
    read the inputs' soft targets), and each position's `top_k` best tokens (with `log_probs`: chosen on the
    raw logits, with their log-softmax)."""
    flat_idx = inputs.scored
    hidden = last_hidden.reshape(-1, last_hidden.shape[-1]).index_select(0, flat_idx)
    num_blocks = inputs.weights.shape[0] * inputs.weights.shape[1]
    reweight = reweighting(settings, flat_idx, num_blocks, inputs.block_size)
    if settings.loss != "ce" and inputs.soft_ids is None:
        raise ValueError(f"loss {settings.loss} needs the target's soft targets (--target_topk)")
    soft = None
    if settings.loss != "ce":
        soft = tuple(t.flatten(0, 2)[flat_idx] for t in (inputs.soft_ids, inputs.soft_probs))
    labels = inputs.labels.flatten()[flat_idx]
    scoring = (settings, reweight, top_k, _with_grad(hidden), log_probs)
    loss_sum, correct, weights, candidates, candidate_log_probs = _FusedLMHeadLoss.apply(
        hidden, head_weight, labels, inputs.weights.flatten()[flat_idx], soft, scoring
    )
    return ScoredRows(
        hidden,
        flat_idx,
        labels,
        weights,
        correct,
        candidates,
        loss_sum,
        candidate_log_probs if log_probs else None,
    )


def loss_terms(inputs: BlockInputs, rows: ScoredRows, correct_rows: torch.Tensor, **family) -> LossTerms:
    """The chunk's LossTerms from its scored rows, `correct_rows` deciding the accuracy and the estimated
    acceptance; `family`: a family's own sums (LossTerms' selector and DSpark fields)."""
    weights = inputs.weights
    scored = weights > 0
    correct = torch.zeros(scored.numel(), dtype=torch.bool, device=weights.device)
    correct[rows.index] = correct_rows
    correct = correct.view_as(scored)
    # Estimated acceptance: the anchor's bonus token plus the prefix of correct, scored positions.
    prefix = torch.cumprod(correct[:, :, 1:].long(), dim=-1).sum(-1)
    blocks = inputs.anchors >= 0
    zero = torch.zeros((), device=weights.device)
    return LossTerms(
        loss_sum=rows.loss_sum,
        weight_sum=inputs.weight_sum.detach(),
        correct_per_pos=correct.sum(dim=(0, 1)).float(),
        count_per_pos=scored.sum(dim=(0, 1)).float(),
        accepted_sum=((1 + prefix) * blocks).sum().float(),
        num_blocks=blocks.sum().float(),
        **{name: family.get(name, zero) for name in _FAMILY_SUMS},
    )


_FAMILY_SUMS = (
    "selector_loss_sum",
    "selector_rows",
    "candidate_hits",
    "unary_correct",
    "reranked",
    "dspark_rows",
    "distill_sum",
    "predicted_acceptance_sum",
    "observed_acceptance_sum",
)


def block_loss_terms(
    last_hidden: torch.Tensor,
    head_weight: torch.Tensor,
    inputs: BlockInputs,
    settings: LossSettings = LossSettings(),  # noqa: B008 - frozen: one shared default is safe
) -> LossTerms:
    """DFlash's loss sums and metric counts for the drafter's output `last_hidden` [B, A*bs, H]: each block
    position scored through the LM head on its own (kl and tv read the inputs' soft targets)."""
    rows = scored_rows(last_hidden, head_weight, inputs, settings)
    return loss_terms(inputs, rows, rows.correct)
