"""Losses of one scored block position against the target: the hard label (`ce`), or the target's top-k
next-token distribution sent with the features (--target_topk), as KL divergence (`kl`) or total variation
(`tv`), optionally mixed with the hard label's CE (--ce_weight).

With p the target's top-k probabilities renormalised to sum to 1 (k = vocabulary: the full distribution)
and q the drafter's softmax:
  kl = sum_top-k p (log p - log q)
  tv = 1/2 sum_vocab |p - q| = 1/2 (sum_top-k |p - q| + 1 - sum_top-k q)   (p is 0 outside the top-k)
TV is what speculative sampling's acceptance depends on (a token is accepted with probability
1 - TV(p, q)); KL's gradient is that of CE against p. Both are computed and differentiated in closed form,
a chunk of rows at a time, inside the chunked LM-head loss (objective.py): the full-vocabulary logits of a
block never exist at once.
"""

from __future__ import annotations

import torch


def renormalised(probs: torch.Tensor) -> torch.Tensor:
    """Top-k probabilities [..., k] as a distribution over those k tokens (at least fp32; all-zero rows stay
    zero)."""
    probs = probs.to(torch.promote_types(probs.dtype, torch.float32))
    return probs / probs.sum(-1, keepdim=True).clamp(min=1e-30)


def _kl(soft_probs: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    return (torch.xlogy(soft_probs, soft_probs) - soft_probs * log_q).sum(-1)


def _tv(soft_probs: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    q = log_q.exp()
    return 0.5 * ((soft_probs - q).abs().sum(-1) + 1.0 - q.sum(-1))


def _kl_gradient(q: torch.Tensor, soft_ids: torch.Tensor, soft_probs: torch.Tensor) -> torch.Tensor:
    return q.scatter_add(1, soft_ids, -soft_probs)


def _tv_gradient(q: torch.Tensor, soft_ids: torch.Tensor, soft_probs: torch.Tensor) -> torch.Tensor:
    # dTV/dq_v = sign(q_v - p_v) / 2, which is +1/2 outside the top-k (p = 0 < q); through the softmax
    # d/dz_u = q_u (g_u - sum_v g_v q_v)
    g = torch.full_like(q, 0.5).scatter(1, soft_ids, 0.5 * torch.sign(q.gather(1, soft_ids) - soft_probs))
    return q * (g - (g * q).sum(-1, keepdim=True))


# each soft loss with its gradient wrt the logits: a name is a --loss choice only with both
SOFT_LOSSES = {"kl": (_kl, _kl_gradient), "tv": (_tv, _tv_gradient)}
LOSSES = ("ce", *SOFT_LOSSES)


def row_losses(
    logits: torch.Tensor,
    labels: torch.Tensor,
    soft_ids: torch.Tensor | None,
    soft_probs: torch.Tensor | None,
    loss: str,
    ce_weight: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(CE of the hard label, the row's loss) for fp32 `logits` [R, V]; `soft_probs` renormalised."""
    nll = torch.logsumexp(logits, dim=-1) - logits.gather(1, labels[:, None]).squeeze(1)
    if loss == "ce":
        return nll, nll
    soft = SOFT_LOSSES[loss][0](soft_probs, torch.log_softmax(logits, dim=-1).gather(1, soft_ids))
    return nll, (1.0 - ce_weight) * soft + ce_weight * nll if ce_weight else soft


def logit_gradients(
    logits: torch.Tensor,
    labels: torch.Tensor,
    soft_ids: torch.Tensor | None,
    soft_probs: torch.Tensor | None,
    loss: str,
    ce_weight: float,
) -> torch.Tensor:
    """d(row loss)/d(logits) [R, V] of `row_losses`, in closed form."""
    q = torch.softmax(logits, dim=-1)
    rows = torch.arange(labels.numel(), device=labels.device)
    if loss == "ce":
        q[rows, labels] -= 1.0
        return q
    grad = SOFT_LOSSES[loss][1](q, soft_ids, soft_probs)
    if ce_weight:
        grad *= 1.0 - ce_weight
        grad[rows, labels] -= ce_weight
        grad += ce_weight * q
    return grad
