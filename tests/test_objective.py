"""Anchors, labels, weights, the chunked loss and the training metrics."""

import math

import torch
import torch.nn.functional as F

from dflash_ddp.drafter.blocks import build_block_inputs, sample_anchors
from dflash_ddp.drafter.objective import block_loss_terms, chunked_weighted_ce
from dflash_ddp.drafter.weighting import (
    LossSettings,
    dpace_weights,
    loss_gamma,
    position_weights,
    scheduled_gamma,
    until_fail_weights,
)


def test_anchors_are_a_pure_function_and_precede_response_tokens():
    mask = torch.tensor([0] * 10 + [1] * 30 + [0] * 5 + [1] * 20)
    a = sample_anchors(mask, 16, seed=3, epoch=1, sample_id=7)
    assert torch.equal(a, sample_anchors(mask, 16, seed=3, epoch=1, sample_id=7))
    assert not torch.equal(a, sample_anchors(mask, 16, seed=3, epoch=2, sample_id=7))  # re-sampled per epoch
    assert not torch.equal(a, sample_anchors(mask, 16, seed=3, epoch=1, sample_id=8))
    assert a.numel() == 16 and torch.all(a[1:] > a[:-1])
    assert all(mask[int(p)] == 1 and mask[int(p) + 1] == 1 for p in a)


def test_anchor_count_is_capped_by_what_the_sequence_has():
    mask = torch.tensor([0] * 5 + [1] * 6)
    assert sample_anchors(mask, 512, 0, 0, 0).tolist() == [5, 6, 7, 8, 9]


def test_anchors_sit_where_the_anchor_and_the_next_token_are_both_response_tokens():
    """Never on the last prompt token before an answer (inference never anchors there: the first block starts
    at the target's first generated token), nor on an answer's last token before the next user turn."""
    mask = torch.tensor([0, 0, 0, 1, 1, 1, 0, 0, 1, 1, 0, 1])
    assert sample_anchors(mask, 512, 0, 0, 0).tolist() == [3, 4, 8]
    assert sample_anchors(torch.tensor([0, 1, 0, 1]), 512, 0, 0, 0).numel() == 0


def test_the_prompt_end_rule_also_anchors_on_the_last_prompt_token_before_each_response():
    mask = torch.tensor([0, 0, 0, 1, 1, 1, 0, 0, 1, 1, 0, 1])
    assert sample_anchors(mask, 512, 0, 0, 0, "prompt_end").tolist() == [2, 3, 4, 7, 8, 10]


def test_block_position_k_is_scored_against_the_token_at_anchor_plus_k():
    ids = torch.arange(100, 130)[None]
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    inputs = build_block_inputs(ids, mask, [torch.tensor([3, 10, 27])], block_size=4, mask_token_id=1)
    blocks = inputs.block_ids.view(3, 4)
    assert blocks[:, 0].tolist() == [103, 110, 127]  # the anchor token itself
    assert torch.all(blocks[:, 1:] == 1)  # then mask tokens
    assert inputs.labels[0, 0].tolist()[1:] == [104, 105, 106]
    assert inputs.labels[0, 1].tolist()[1:] == [111, 112, 113]
    assert inputs.position_ids[0, 30:].tolist() == [3, 4, 5, 6, 10, 11, 12, 13, 27, 28, 29, 30]
    assert torch.all(inputs.weights[..., 0] == 0)  # position 0 is never scored
    # anchor 27: positions 28, 29 exist, 30 is past the end -> weight 0
    assert inputs.weights[0, 2, 1] > 0 and inputs.weights[0, 2, 2] > 0 and inputs.weights[0, 2, 3] == 0


def test_prompt_positions_carry_no_weight():
    ids = torch.arange(20)[None]
    mask = torch.zeros_like(ids)
    mask[0, 6:] = 1
    inputs = build_block_inputs(ids, mask, [torch.tensor([4])], block_size=4, mask_token_id=1)
    assert inputs.weights[0, 0, 1] == 0  # token 5 is prompt
    assert inputs.weights[0, 0, 2] > 0


def test_decay_weights_follow_the_paper():
    assert loss_gamma(16) == 7 and loss_gamma(10) == 5 and loss_gamma(8) == 4
    w = position_weights(16)
    assert w[0] == 0 and w[1] == 1 and math.isclose(float(w[8]), math.exp(-1), rel_tol=1e-6)


def test_a_decay_schedule_starts_at_its_start_and_ends_at_its_end():
    assert [scheduled_gamma(1.0, 3.0, s, 5) for s in range(5)] == [1.0, 1.5, 2.0, 2.5, 3.0]
    assert scheduled_gamma(1.0, 3.0, 9, 5) == 3.0  # steps past the planned end keep the end
    assert scheduled_gamma(1.0, 3.0, 0, 1) == 1.0  # a one-step run trains with the start


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


def test_dpace_weights_equal_the_closed_form():
    """Block of 4 (positions 1-3 scored) and one cut short by the response's end (only positions 1-2)."""
    ce = torch.tensor([0.1, 0.7, 1.5, 0.2, 2.0])
    scored = torch.tensor([1, 2, 3, 5, 6])  # flat indices into [2 blocks, 4 positions]
    a = 0.5
    q = [(1 - a) * math.exp(-c) + a for c in ce.tolist()]
    p1, p2, p3 = q[0], q[0] * q[1], q[0] * q[1] * q[2]  # prefix products of block 0
    r1, r2 = q[3], q[3] * q[4]  # block 1: no label at position 3, so its chain ends after position 2
    expected = torch.tensor([p1 + p2 + p3, p2 + p3, p3, r1 + r2, r2])
    torch.testing.assert_close(dpace_weights(ce, scored, 2, 4, a), expected)
    # a = 1: every probability counts as 1, so position j weighs the number of positions from j to the end
    assert dpace_weights(ce, scored, 2, 4, 1.0).tolist() == [3.0, 2.0, 1.0, 2.0, 1.0]


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


def test_auf_weights_keep_each_block_up_to_its_first_wrong_position():
    """Blocks of 5 (positions 1-4): right, right, wrong, right -> 1 1 1 0 (the failure counts, what follows
    does not); wrong first -> 1 0 0 0; a block cut short after position 2, both right -> 1 1."""
    correct = torch.tensor([True, True, False, True, False, True, True, True, True, True])
    scored = torch.tensor([1, 2, 3, 4, 6, 7, 8, 9, 11, 12])  # flat indices into [3 blocks, 5 positions]
    weights = until_fail_weights(correct, scored, 3, 5)
    assert weights.tolist() == [1, 1, 1, 0, 1, 0, 0, 0, 1, 1]


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
