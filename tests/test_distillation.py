"""Soft-target losses (drafter/distillation.py and the chunked LM-head loss): values and gradients against
dense autograd on the whole vocabulary, top-k = vocabulary equal to the full distribution."""

import pytest
import torch

from dflash_ddp.data.batch import SoftTargets
from dflash_ddp.drafter.blocks import build_block_inputs
from dflash_ddp.drafter.distillation import SOFT_LOSSES, logit_gradients, renormalised, row_losses
from dflash_ddp.drafter.objective import chunked_weighted_ce
from dflash_ddp.drafter.weighting import LossSettings

V = 37


def dense_loss(logits, labels, p_full, loss, ce_weight):
    """The textbook definitions over the whole vocabulary, through autograd."""
    log_q = torch.log_softmax(logits, -1)
    nll = -log_q.gather(1, labels[:, None]).squeeze(1)
    if loss == "ce":
        return nll
    textbook = {
        "kl": lambda: (torch.xlogy(p_full, p_full) - p_full * log_q).sum(-1),
        "tv": lambda: 0.5 * (p_full - log_q.exp()).abs().sum(-1),
    }
    soft = textbook[loss]()  # a --loss choice without its definition here fails below
    return (1 - ce_weight) * soft + ce_weight * nll


def top_k(p_full, k):
    top = p_full.topk(k, -1)
    return top.indices, renormalised(top.values)


def scatter_dense(ids, probs):
    return torch.zeros(ids.shape[0], V, dtype=probs.dtype).scatter(1, ids, probs)


@pytest.mark.parametrize(
    "loss,ce_weight", [("ce", 0.0), *((name, w) for name in SOFT_LOSSES for w in (0.0, 0.3))]
)
@pytest.mark.parametrize("k", [3, V])
def test_row_losses_and_closed_form_gradients_match_dense_autograd(loss, ce_weight, k):
    torch.manual_seed(0)
    logits = torch.randn(6, V, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, V, (6,))
    p_full = torch.softmax(torch.randn(6, V, dtype=torch.float64) * 2, -1)
    ids, probs = top_k(p_full, k)
    probs = probs.double()
    expected = dense_loss(logits, labels, scatter_dense(ids, probs), loss, ce_weight)
    weights = torch.rand(6, dtype=torch.float64)
    (grad,) = torch.autograd.grad((expected * weights).sum(), logits)
    nll, got = row_losses(logits.detach(), labels, ids, probs, loss, ce_weight)
    torch.testing.assert_close(got, expected.detach())
    torch.testing.assert_close(nll, dense_loss(logits, labels, None, "ce", 0).detach())
    closed = logit_gradients(logits.detach(), labels, ids, probs, loss, ce_weight) * weights[:, None]
    torch.testing.assert_close(closed, grad)


@pytest.mark.parametrize("loss", SOFT_LOSSES)
def test_top_k_with_k_equal_to_the_vocabulary_is_the_full_distribution(loss):
    """Sent as top-V (any order), the soft target is the target's whole distribution: the loss equals the
    loss against the full distribution, and a smaller k differs."""
    torch.manual_seed(1)
    logits = torch.randn(5, V, dtype=torch.float64)
    labels = torch.randint(0, V, (5,))
    p_full = torch.softmax(torch.randn(5, V, dtype=torch.float64), -1)
    ids, probs = top_k(p_full, V)
    full = dense_loss(logits, labels, p_full, loss, 0.0)
    torch.testing.assert_close(row_losses(logits, labels, ids, probs.double(), loss, 0.0)[1], full)
    ids4, probs4 = top_k(p_full, 4)
    assert not torch.allclose(row_losses(logits, labels, ids4, probs4.double(), loss, 0.0)[1], full)


@pytest.mark.parametrize("loss", SOFT_LOSSES)
def test_chunked_lm_head_loss_against_soft_targets_matches_autograd(loss):
    """Through the LM head, in chunks smaller than the rows: the loss sum and the hidden states' gradient
    equal autograd through full logits."""
    torch.manual_seed(2)
    hidden = torch.randn(10, 8, dtype=torch.float32, requires_grad=True)
    head = torch.randn(V, 8, dtype=torch.float32)
    labels = torch.randint(0, V, (10,))
    weights = torch.rand(10, dtype=torch.float32)
    ids, probs = top_k(torch.softmax(torch.randn(10, V, dtype=torch.float32), -1), 5)
    got, _ = chunked_weighted_ce(
        hidden,
        head,
        labels,
        weights,
        LossSettings(loss=loss, ce_weight=0.1, chunk_rows=3),
        None,
        (ids, probs),
    )
    (grad_got,) = torch.autograd.grad(got, hidden)
    expected = (dense_loss(hidden @ head.T, labels, scatter_dense(ids, probs), loss, 0.1) * weights).sum()
    (grad_expected,) = torch.autograd.grad(expected, hidden)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad_got, grad_expected, rtol=1e-5, atol=1e-5)


def test_each_label_gets_the_distribution_of_the_position_before_it():
    """The label at anchor+k is predicted by the target at anchor+k-1: its soft target comes from there."""
    seq = 12
    ids = torch.arange(seq)[None]
    mask = torch.ones_like(ids)
    # soft target at position t: top-1 token 100 + t, top-2 token 200 + t with probability 3:1
    soft = SoftTargets(
        torch.stack([100 + ids, 200 + ids], -1).int(),
        torch.tensor([0.75, 0.25]).expand(1, seq, 2).to(torch.bfloat16),
    )
    inputs = build_block_inputs(ids, mask, [torch.tensor([3, 7])], 4, 99, soft=soft)
    for a, anchor in enumerate([3, 7]):
        for k in range(1, 4):
            if anchor + k < seq:
                assert inputs.soft_ids[0, a, k].tolist() == [100 + anchor + k - 1, 200 + anchor + k - 1]
    torch.testing.assert_close(inputs.soft_probs[0, 0, 1], torch.tensor([0.75, 0.25]))
