"""The drafter's training blocks: where anchors sit, what each block position is scored against."""

import torch

from dflash_ddp.drafter.blocks import anchor_count, build_block_inputs, sample_anchors


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


def test_anchors_scale_with_length_past_the_scale_and_short_sequences_keep_theirs():
    """--anchor_scale_tokens 512 with 16 anchors: a 4096-token conversation trains 128 blocks (16 per 512
    tokens), one of 512 tokens or fewer the same 16 as without scaling (so a short run is unchanged)."""
    assert anchor_count(16, 4096, 512) == 128 and anchor_count(16, 4097, 512) == 129
    assert anchor_count(16, 300, 512) == 16 and anchor_count(16, 4096, 0) == 16
    long_mask = torch.tensor([0] * 96 + [1] * 4000)
    scaled = sample_anchors(long_mask, 16, 0, 0, 0, scale_tokens=512)
    assert scaled.numel() == 128 and all(long_mask[int(p)] and long_mask[int(p) + 1] for p in scaled)
    short_mask = torch.tensor([0] * 50 + [1] * 250)
    assert torch.equal(
        sample_anchors(short_mask, 16, 0, 0, 0, scale_tokens=512), sample_anchors(short_mask, 16, 0, 0, 0)
    )


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
