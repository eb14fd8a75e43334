"""The chunked LM-head loss: value and gradient, the metrics, D-PACE and AUF weights held constant in the
gradient, and the normalisation by the blocks with a label."""

import torch
import torch.nn.functional as F

from dflash_ddp.drafter.blocks import build_block_inputs
from dflash_ddp.drafter.objective import block_loss_terms, chunked_weighted_ce
from dflash_ddp.drafter.weighting import (
    LossSettings,
    dpace_weights,
    until_fail_weights,
)


def test_chunked_loss_equals_unchunked_in_value_and_gradient():
    torch.manual_seed(0)
    hidden = torch.randn(37, 16, requires_grad=True)
    head = torch.randn(50, 16)
    labels = torch.randint(0, 50, (37,))
    weights = torch.rand(37)
    loss, correct = chunked_weighted_ce(hidden, head, labels, weights, LossSettings(chunk_rows=8))
    loss.backward()
    grad_chunked = hidden.grad.clone()
    hidden.grad = None
    logits = hidden @ head.T
    ref = (F.cross_entropy(logits, labels, reduction="none") * weights).sum()
    ref.backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(grad_chunked, hidden.grad)
    assert torch.equal(correct, logits.argmax(-1) == labels)


def test_metrics_count_a_perfect_prediction_as_full_acceptance():
    """With one-hot hidden states the LM head picks exactly the labels: accuracy 1, tau = block size."""
    vocab, bs = 40, 4
    ids = torch.randint(2, vocab, (1, 30))
    inputs = build_block_inputs(ids, torch.ones_like(ids), [torch.tensor([2, 9, 20])], bs, mask_token_id=1)
    hidden = F.one_hot(inputs.labels, vocab).float().view(1, -1, vocab) * 10
    terms = block_loss_terms(hidden, torch.eye(vocab), inputs, LossSettings(chunk_rows=5))
    metrics = terms.metrics()
    assert metrics["accuracy"] == 1.0
    assert metrics["tau_estimate"] == bs
    shifted = torch.roll(hidden, shifts=1, dims=-1)  # wrong everywhere: only the bonus token is accepted
    assert (
        block_loss_terms(shifted, torch.eye(vocab), inputs, LossSettings(chunk_rows=5)).metrics()[
            "tau_estimate"
        ]
        == 1.0
    )


def test_dpace_weights_are_constants_of_the_gradient():
    """The loss's gradient is sum_j w_j grad CE_j with w computed from the detached CE: no gradient flows
    through the weights (they would otherwise push the drafter to be less confident)."""
    torch.manual_seed(0)
    hidden = torch.randn(10, 16, requires_grad=True)
    head = torch.randn(50, 16)
    labels = torch.randint(0, 50, (10,))
    scored = torch.tensor([1, 2, 3, 5, 6, 7, 9, 10, 11, 13])  # 4 blocks of 4: rows of positions 1-3

    def reweight(nll, correct=None):
        return dpace_weights(nll, scored, 4, 4, 0.5)

    loss, _ = chunked_weighted_ce(hidden, head, labels, torch.zeros(10), LossSettings(chunk_rows=3), reweight)
    loss.backward()
    ce = F.cross_entropy(hidden @ head.T, labels, reduction="none")
    reference = (reweight(ce.detach()) * ce).sum()
    torch.testing.assert_close(loss, reference.detach())
    grad = torch.autograd.grad(reference, hidden, retain_graph=True)[0]
    torch.testing.assert_close(hidden.grad, grad)
    through = torch.autograd.grad((reweight_live(ce, scored) * ce).sum(), hidden)[0]
    assert not torch.allclose(through, grad)  # what a non-detached weight would have given


def reweight_live(ce, scored):
    """D-PACE's formula without detaching, for the comparison above."""
    q = torch.zeros(16).index_put((scored,), 0.5 * torch.exp(-ce) + 0.5).view(4, 4)
    prefix = torch.cumprod(q[:, 1:], dim=1)
    w = torch.cat([torch.zeros(4, 1), prefix.flip(1).cumsum(1).flip(1)], dim=1)
    return w.flatten()[scored]


def test_auf_trains_only_up_to_the_first_failure_with_the_weights_held_constant():
    """The loss is the CE of the kept rows, divided by the blocks with a label; the gradient is the kept
    rows' CE gradient (the weights come from argmaxes and stay constants)."""
    torch.manual_seed(0)
    ids = torch.randint(2, 30, (1, 24))
    mask = torch.ones_like(ids)
    auf = LossSettings(weighting="auf", chunk_rows=4)
    inputs = build_block_inputs(ids, mask, [torch.tensor([2, 8, 14])], 5, mask_token_id=1, settings=auf)
    assert float(inputs.weight_sum) == 3.0
    vocab = 30
    hidden = torch.randn(1, 3 * 5, vocab, requires_grad=True)
    hidden.data[0, 1, ids[0, 3]] = 50.0  # block 0: position 1 right, so position 2 is kept too
    terms = block_loss_terms(hidden, torch.eye(vocab), inputs, auf)
    terms.loss_sum.backward()
    rows = hidden.detach()[0]
    labels = inputs.labels.flatten()
    correct = rows.argmax(-1) == labels
    kept = until_fail_weights(correct[inputs.scored], inputs.scored, 3, 5)
    assert kept.tolist()[:2] == [1, 1] and 0 < kept.sum() < len(kept)
    ce = F.cross_entropy(hidden[0][inputs.scored], labels[inputs.scored], reduction="none")
    torch.testing.assert_close(terms.loss_sum, (kept * ce).sum())
    expected = torch.autograd.grad((kept * ce).sum(), hidden)[0]
    torch.testing.assert_close(hidden.grad, expected)


def test_dpace_normalises_by_the_blocks_with_a_label():
    ids = torch.arange(3, 23).view(1, 20)
    mask = torch.zeros_like(ids)
    mask[0, 5:18] = 1
    anchors = [torch.tensor([5, 9, 16])]  # the last block has labels at positions 1 only (17)
    decay = build_block_inputs(ids, mask, anchors, 4, mask_token_id=1, min_slots=5)
    dpace_settings = LossSettings(weighting="dpace", dpace_smoothing=0.5, chunk_rows=4)
    dpace = build_block_inputs(ids, mask, anchors, 4, mask_token_id=1, settings=dpace_settings, min_slots=5)
    assert float(dpace.weight_sum) == 3.0  # 3 anchors with a label; the 2 padding slots have none
    torch.testing.assert_close(decay.weight_sum, decay.weights.sum())
    assert torch.equal(dpace.weights > 0, decay.weights > 0) and set(dpace.weights.unique().tolist()) == {
        0.0,
        1.0,
    }
    vocab = 30
    hidden = torch.randn(1, 5 * 4, vocab)
    terms = block_loss_terms(hidden, torch.eye(vocab), dpace, dpace_settings)
    assert float(terms.weight_sum) == 3.0 and torch.isfinite(terms.loss_sum)
