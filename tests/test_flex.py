"""The flex path: its BlockMask against torch's own builder, and a bounded number of compiled graphs."""

import pytest
import torch
from torch._dynamo.utils import counters
from torch.nn.attention.flex_attention import create_block_mask

import dflash_ddp.drafter.flex as flex
from dflash_ddp.drafter.attention import dense_block_mask
from dflash_ddp.drafter.blocks import build_block_inputs, sample_anchors
from dflash_ddp.drafter.flex import compiled_flex, flex_block_mask, min_anchor_slots
from dflash_ddp.drafter.model import DFlashDraftModel
from dflash_ddp.drafter.weighting import LossSettings

from helpers import small_draft_config


def tiles(mask, full: bool) -> torch.Tensor:
    """The tiles a BlockMask lists as partial (or full), as a dense [B, H, q_tiles, kv_tiles] bool."""
    num, index = (
        (mask.full_kv_num_blocks, mask.full_kv_indices) if full else (mask.kv_num_blocks, mask.kv_indices)
    )
    keep = torch.arange(index.shape[-1]) < num[..., None]
    out = torch.zeros(index.shape, dtype=torch.bool)
    return out.scatter_(-1, index.long(), keep)


@pytest.mark.parametrize("block_size", [16, 10])
def test_block_mask_equals_torch_builder(block_size):
    """Partial and full tiles equal create_block_mask's on random anchors, padding slots, lengths that are not
    multiples of the tile, a block size that does not divide it, and sliding windows."""
    g = torch.Generator().manual_seed(block_size)
    for _ in range(40):
        batch, slots = (
            int(torch.randint(1, 4, (1,), generator=g)),
            int(torch.randint(1, 24, (1,), generator=g)),
        )
        context = int(torch.randint(2, 600, (1,), generator=g))
        anchors = torch.randint(0, context - 1, (batch, slots), generator=g).sort(dim=1).values
        anchors[torch.rand(batch, slots, generator=g) < 0.2] = -1
        window = [None, block_size + 3, 150][int(torch.randint(0, 3, (1,), generator=g))]
        allowed = dense_block_mask(anchors, context, block_size, window)[:, 0]
        reference = create_block_mask(
            lambda b, h, q, kv, allowed=allowed: allowed[b, q, kv],
            batch,
            None,
            *allowed.shape[1:],
            device="cpu",
        )
        built = flex_block_mask(anchors, context, block_size, window)
        assert torch.equal(tiles(built, full=False), tiles(reference, full=False))
        assert torch.equal(tiles(built, full=True), tiles(reference, full=True))
        assert torch.equal(built.to_dense(), reference.to_dense())


def test_compiled_flex_keeps_few_graphs_over_a_varied_schedule(monkeypatch):
    """Batches of 1-4 sequences, 1-24 anchors and 40-700 tokens through the drafter with flex compiled once
    (aot_eager; forward only: compiled flex has no CPU backward): two graphs (one sequence or several: sizes of 1 are specialised)
    and no fallback to eager flex, which would materialise the scores (a fallback raises)."""
    monkeypatch.setattr(flex, "kernel_for", lambda device: compiled_flex("aot_eager"))
    torch.manual_seed(0)
    config = small_draft_config(block_size=16)
    drafter = DFlashDraftModel(config)
    features_width = config.hidden_size * len(config.target_layer_ids)
    g = torch.Generator().manual_seed(1)
    counters.clear()
    for batch in (1, 3, 1, 2, 4, 1):
        context = int(torch.randint(40, 700, (1,), generator=g))
        loss_mask = torch.zeros(batch, context, dtype=torch.bool)
        loss_mask[:, context // 3 :] = True
        anchors = [
            sample_anchors(loss_mask[b], int(torch.randint(1, 25, (1,), generator=g)), 0, 0, b)
            for b in range(batch)
        ]
        ids = torch.randint(0, config.vocab_size, (batch, context), generator=g)
        inputs = build_block_inputs(
            ids,
            loss_mask,
            anchors,
            config.block_size,
            config.mask_token_id,
            LossSettings(gamma=7.0),
            min_anchor_slots(config.block_size),
        )
        embeds = torch.randn(*inputs.block_ids.shape, config.hidden_size)
        features = torch.randn(batch, context, features_width)
        mask = flex_block_mask(inputs.anchors, context, config.block_size)
        with torch.no_grad():
            drafter(embeds, features, inputs.position_ids, mask)
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])
