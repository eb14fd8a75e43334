"""The chunked LM-head loss, fused (each piece's logits computed once): value and gradient against autograd
through full logits, the products it runs, the metrics, D-PACE and AUF weights held constant in the gradient,
and the normalisation by the blocks with a label."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from dflash_ddp.drafter.blocks import build_block_inputs
from dflash_ddp.drafter.objective import block_loss_terms, chunked_weighted_ce, scored_rows
from dflash_ddp.drafter.weighting import (
    LossSettings,
    dpace_weights,
    until_fail_weights,
)


@pytest.mark.parametrize(
    "chunk_rows", [1, 4, 7, 37, 64]
)  # 37 rows: pieces that divide them and ones that do not
@pytest.mark.parametrize(("scale", "softcap"), [(1.0, None), (0.25, 5.0), (2.0, None), (1.0, 3.0)])
def test_fused_loss_equals_autograd_through_full_logits(chunk_rows, scale, softcap):
    """The fused loss (logits once per piece, the hidden states' gradient taken in the forward) against
    autograd through the whole [rows, vocab] logits: the loss sum, the argmax flags and the gradient, with
    weights, rows that weigh nothing (positions without a label), a logit scale and soft-capping, and an
    incoming gradient other than 1 (the trainer divides by the global weight sum)."""
    torch.manual_seed(0)
    hidden = torch.randn(37, 16) * 0.5
    head = torch.randn(50, 16)
    labels = torch.randint(0, 50, (37,))
    weights = torch.rand(37) * (torch.rand(37) > 0.3)
    settings = LossSettings(chunk_rows=chunk_rows, logit_scale=scale, logit_softcap=softcap)
    fused = hidden.clone().requires_grad_()
    loss, correct = chunked_weighted_ce(fused, head, labels, weights, settings)
    (loss / 7.0).backward()
    reference = hidden.clone().requires_grad_()
    logits = reference @ head.T * scale
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    expected = (F.cross_entropy(logits, labels, reduction="none") * weights).sum()
    (expected / 7.0).backward()
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(fused.grad, reference.grad)
    assert torch.equal(correct, logits.argmax(-1) == labels)
    assert not fused.grad[weights == 0].any()


ON_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")


@pytest.mark.parametrize(
    ("device", "backend"),
    [("cpu", None), pytest.param("cuda", None, marks=ON_GPU), pytest.param("cuda", "inductor", marks=ON_GPU)],
)
def test_fused_loss_in_bf16_is_within_bf16_rounding_of_fp64_autograd(device, backend):
    """As the trainer runs on CUDA: bf16 rows and head, fp32 logits, each piece compiled there. The
    gradient, kept in bf16 and scaled in backward, is as close to autograd's in fp64 as bf16 allows (measured
    on the CPU: 0.3% in norm, as the unfused loss's)."""
    torch.manual_seed(0)
    hidden, head = torch.randn(300, 256, device=device), torch.randn(1024, 256, device=device) * 0.05
    labels, weights = torch.randint(0, 1024, (300,), device=device), torch.rand(300, device=device)
    settings = LossSettings(chunk_rows=128, logit_softcap=30.0, compile_backend=backend)
    fused = hidden.bfloat16().requires_grad_()
    loss, _ = chunked_weighted_ce(fused, head.bfloat16(), labels, weights, settings)
    (loss / 37.0).backward()
    reference = hidden.bfloat16().double().requires_grad_()
    logits = torch.tanh(reference @ head.bfloat16().double().T / 30.0) * 30.0
    expected = (F.cross_entropy(logits, labels, reduction="none") * weights.double()).sum()
    (expected / 37.0).backward()
    assert fused.grad.dtype == torch.bfloat16
    torch.testing.assert_close(loss.double(), expected, rtol=1e-3, atol=0)
    error = (fused.grad.double() - reference.grad).norm() / reference.grad.norm()
    assert error < 2**-8, error


def test_the_backward_runs_no_product_and_no_grad_runs_no_gradient():
    """The LM head's products run in the forward alone: two per piece with a gradient to take (the logits
    and the hidden states' gradient), one without (no_grad: evaluation, the FLOP count's forward), and the
    backward only scales what the forward kept."""
    torch.manual_seed(0)
    hidden = torch.randn(10, 8, requires_grad=True)
    head, labels, weights = torch.randn(20, 8), torch.randint(0, 20, (10,)), torch.rand(10)
    settings = LossSettings(chunk_rows=4)  # 3 pieces
    with ProductCount() as forward:
        loss, _ = chunked_weighted_ce(hidden, head, labels, weights, settings)
    with ProductCount() as backward:
        loss.backward()
    with torch.no_grad(), ProductCount() as no_grad:
        chunked_weighted_ce(hidden, head, labels, weights, settings)
    assert (forward.products, backward.products, no_grad.products) == (6, 0, 3)


@pytest.mark.parametrize(("scale", "softcap"), [(1.0, None), (0.25, 5.0)])
def test_the_candidates_log_probs_and_their_gradient_come_from_the_same_pass(scale, softcap):
    """LiLiCorr's candidates (the top 4 by raw logits, as the engines choose them) and their raw
    log-softmax, taken with the loss: values and the gradient of loss + sum(R * log-probs) equal autograd's
    through the full logits, with three products per piece in the forward and none in backward."""
    torch.manual_seed(0)
    ids = torch.randint(0, 49, (1, 40))
    inputs = build_block_inputs(ids, torch.ones_like(ids), [torch.tensor([3, 9, 15, 21, 30])], 4, 49)
    settings = LossSettings(chunk_rows=7, logit_scale=scale, logit_softcap=softcap)
    out, head = torch.randn(1, 20, 16), torch.randn(50, 16)
    fused = out.clone().requires_grad_()
    with ProductCount() as forward:
        rows = scored_rows(fused, head, inputs, settings, top_k=4, log_probs=True)
    pull = torch.randn(rows.candidate_log_probs.shape)
    with ProductCount() as backward:
        (rows.loss_sum + (pull * rows.candidate_log_probs).sum()).backward()
    reference = out.clone().requires_grad_()
    raw = reference.flatten(0, 1)[inputs.scored] @ head.T
    logits = raw * scale
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    labels = inputs.labels.flatten()[inputs.scored]
    loss = (F.cross_entropy(logits, labels, reduction="none") * rows.weights).sum()
    candidates = raw.topk(4).indices
    log_probs = raw.log_softmax(dim=-1).gather(-1, candidates)
    (loss + (pull * log_probs).sum()).backward()
    assert torch.equal(rows.candidates, candidates)
    torch.testing.assert_close(rows.candidate_log_probs, log_probs)
    torch.testing.assert_close(rows.loss_sum, loss)
    torch.testing.assert_close(fused.grad, reference.grad)
    pieces = -(-labels.numel() // 7)
    assert (forward.products, backward.products) == (3 * pieces, 0)


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=ON_GPU)],
)
def test_the_candidates_log_probs_in_bf16_are_within_bf16_rounding_of_fp64_autograd(device):
    """As LiLiCorr trains on CUDA: bf16 rows and head. The log-probabilities and the gradient of loss +
    sum(R * log-probs), whose candidate part is formed from bf16 head rows and a bf16 expected row, are as
    close to fp64 autograd's as the CE's alone (measured on the CPU: 0.33% in norm, 0.008 in log-prob)."""
    torch.manual_seed(0)
    ids = torch.randint(0, 1023, (1, 200))
    inputs = build_block_inputs(ids, torch.ones_like(ids), [torch.arange(5, 190, 9)], 8, 1023)
    inputs = inputs.to(torch.device(device))
    out, head = torch.randn(1, 168, 256, device=device), torch.randn(1024, 256, device=device) * 0.05
    fused = out.bfloat16().requires_grad_()
    rows = scored_rows(fused, head.bfloat16(), inputs, LossSettings(chunk_rows=64), top_k=8, log_probs=True)
    pull = torch.randn(rows.candidate_log_probs.shape, device=device)
    (rows.loss_sum + (pull * rows.candidate_log_probs).sum()).backward()
    reference = out.bfloat16().double().requires_grad_()
    raw = reference.flatten(0, 1)[inputs.scored] @ head.bfloat16().double().T
    labels = inputs.labels.flatten()[inputs.scored]
    loss = (F.cross_entropy(raw, labels, reduction="none") * rows.weights.double()).sum()
    log_probs = raw.log_softmax(dim=-1).gather(-1, rows.candidates)
    (loss + (pull.double() * log_probs).sum()).backward()
    assert (rows.candidate_log_probs.double() - log_probs).abs().max() < 0.02
    error = (fused.grad.double() - reference.grad).norm() / reference.grad.norm()
    assert error < 2**-8, error


class ProductCount(TorchDispatchMode):
    """Counts the matrix products dispatched inside it."""

    products = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.products += func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm)
        return func(*args, **(kwargs or {}))


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


# (LossSettings fields, best tokens, candidates' log-probabilities): the default's D-PACE with a target's
# logit scale and soft cap; total variation against soft targets with the hard label's CE and the best tokens
# (DFlash2's selector reads them); LiLiCorr's candidates with their log-probabilities
COMPILED_CASES = {
    "dpace-scale-cap": ({"weighting": "dpace", "logit_scale": 0.25, "logit_softcap": 5.0}, 0, False),
    "tv-best-tokens": ({"loss": "tv", "ce_weight": 0.1, "soft_targets": True}, 4, False),
    "candidates-log-probs": ({}, 4, True),
}


@pytest.mark.parametrize("case", sorted(COMPILED_CASES))
def test_the_compiled_loss_equals_eager_with_one_graph_for_every_piece(case):
    """On CUDA each piece of the loss runs compiled (`LossSettings.compile_backend`; here aot_eager, the same
    graph without code generation): the loss, flags, weights, best tokens, log-probabilities and gradient
    equal eager's, with one graph for pieces of 8 and of 5 rows, and one more without the gradient."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from dflash_ddp.drafter.blocks import SoftTargets

    fields, top_k, log_probs = COMPILED_CASES[case]
    torch.manual_seed(0)
    ids = torch.randint(0, 49, (1, 60))
    soft = SoftTargets(
        torch.randint(0, 50, (1, 60, 4)).int(), torch.softmax(torch.randn(1, 60, 4), -1).bfloat16()
    )
    anchors = [torch.tensor([3, 9, 15, 21, 30, 41, 50])]  # 7 blocks x 3 scored positions: pieces 8, 8, 5
    out, head = torch.randn(1, 28, 16), torch.randn(50, 16)
    pull = torch.randn(21, top_k)
    inputs = build_block_inputs(ids, torch.ones_like(ids), anchors, 4, 49, LossSettings(**fields), soft=soft)

    def score(backend, hidden):
        settings = LossSettings(chunk_rows=8, compile_backend=backend, **fields)
        return scored_rows(hidden, head, inputs, settings, top_k=top_k, log_probs=log_probs)

    def score_and_grad(backend):
        hidden = out.clone().requires_grad_()
        rows = score(backend, hidden)
        pulled = rows.loss_sum + (pull * rows.candidate_log_probs).sum() if log_probs else rows.loss_sum
        pulled.backward()
        return rows, hidden.grad

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    (eager, eager_grad), (compiled, compiled_grad) = score_and_grad(None), score_and_grad(counter)
    assert counter.frame_count == 1, counter.frame_count
    for name in ("loss_sum", "correct", "weights", "candidates", "candidate_log_probs"):
        torch.testing.assert_close(getattr(compiled, name), getattr(eager, name), rtol=0, atol=0, msg=name)
    torch.testing.assert_close(compiled_grad, eager_grad, rtol=0, atol=0)
    with torch.no_grad():  # evaluation's scoring: one more graph, the same loss
        again = score(counter, out)
    assert counter.frame_count == 2
    torch.testing.assert_close(again.loss_sum, eager.loss_sum, rtol=0, atol=0)
