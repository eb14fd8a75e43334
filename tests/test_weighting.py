"""Position weights: the paper's decay and its schedule, D-PACE's closed form, Spec-AUF's support."""

import math

import torch

from dflash_ddp.drafter.weighting import (
    POSITION_WEIGHTINGS,
    LossSettings,
    dpace_weights,
    label_weights,
    loss_gamma,
    position_weights,
    reweighting,
    scheduled_gamma,
    until_fail_weights,
)


def test_decay_weights_follow_the_paper():
    assert loss_gamma(16) == 7 and loss_gamma(10) == 5 and loss_gamma(8) == 4
    w = position_weights(16)
    assert w[0] == 0 and w[1] == 1 and math.isclose(float(w[8]), math.exp(-1), rel_tol=1e-6)


def test_a_decay_schedule_starts_at_its_start_and_ends_at_its_end():
    assert [scheduled_gamma(1.0, 3.0, s, 5) for s in range(5)] == [1.0, 1.5, 2.0, 2.5, 3.0]
    assert scheduled_gamma(1.0, 3.0, 9, 5) == 3.0  # steps past the planned end keep the end
    assert scheduled_gamma(1.0, 3.0, 0, 1) == 1.0  # a one-step run trains with the start


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


def test_auf_weights_keep_each_block_up_to_its_first_wrong_position():
    """Blocks of 5 (positions 1-4): right, right, wrong, right -> 1 1 1 0 (the failure counts, what follows
    does not); wrong first -> 1 0 0 0; a block cut short after position 2, both right -> 1 1."""
    correct = torch.tensor([True, True, False, True, False, True, True, True, True, True])
    scored = torch.tensor([1, 2, 3, 4, 6, 7, 8, 9, 11, 12])  # flat indices into [3 blocks, 5 positions]
    weights = until_fail_weights(correct, scored, 3, 5)
    assert weights.tolist() == [1, 1, 1, 0, 1, 0, 0, 0, 1, 1]


def test_every_weighting_a_run_can_choose_weighs_the_scored_rows():
    """Each --position_weighting choice is computed, none falls back to another's weights."""
    scored = torch.tensor([1, 2, 3, 5, 6])
    nll, correct = torch.tensor([0.1, 0.7, 1.5, 0.2, 2.0]), torch.tensor([True, False, True, True, True])
    seen = {}
    for name in POSITION_WEIGHTINGS:
        settings = LossSettings(weighting=name)
        weigh = reweighting(settings, scored, 2, 4)
        if name == "decay":
            assert weigh is None and not settings.reweighted
            seen[name] = tuple(label_weights(4, settings).repeat(2)[scored].tolist())
        else:
            assert settings.reweighted and label_weights(4, settings).tolist() == [0, 1, 1, 1]
            seen[name] = tuple(weigh(nll, correct).tolist())
    assert len(set(seen.values())) == len(POSITION_WEIGHTINGS)
