"""The block-sparse attention path against the dense reference; what the other paths are handed."""

import pytest
import torch
import torch.nn.functional as F

import dflash_ddp.drafter.attention as attention
from dflash_ddp.drafter.attention import (
    block_layout,
    block_sparse_attention,
    dense_attention,
    dense_block_mask,
)
from dflash_ddp.drafter.blocks import build_block_inputs
from dflash_ddp.drafter.flex import flex_block_mask
from dflash_ddp.drafter.model import DFlashDraftModel

from helpers import small_draft_config


def random_case(seed, batch, slots, seq, bs, heads, kv_heads, dim=8, dtype=torch.float64):  # noqa: PLR0913
    """Anchors per row (sorted, some rows padded with -1 slots, some near the end, some closer than a
    block so that blocks overlap later anchors' positions) and q/k/v/grad tensors."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for b in range(batch):
        count = slots if b == 0 else int(torch.randint(1, slots + 1, (1,), generator=g))
        count = min(count, seq)
        picked = torch.randperm(seq, generator=g)[:count].sort().values
        if b == batch - 1:
            picked[-1] = seq - 1  # an anchor on the last position: its block runs past the sequence
        rows.append(torch.cat([picked, torch.full((slots - count,), -1)]))
    anchors = torch.stack(rows)
    q = torch.randn(batch, heads, slots * bs, dim, dtype=dtype, generator=g, requires_grad=True)
    k = torch.randn(batch, kv_heads, seq + slots * bs, dim, dtype=dtype, generator=g, requires_grad=True)
    v = torch.randn(batch, kv_heads, seq + slots * bs, dim, dtype=dtype, generator=g, requires_grad=True)
    grad = torch.randn(batch, heads, slots * bs, dim, dtype=dtype, generator=g)
    return anchors, q, k, v, grad


CASES = [  # seed, batch, slots, seq, block size, heads, kv heads
    (0, 1, 6, 30, 4, 2, 2),
    (1, 3, 9, 40, 4, 4, 2),  # GQA, padded rows
    (2, 2, 20, 24, 4, 4, 1),  # nearly every position an anchor: blocks overlap each other
    (3, 2, 5, 7, 8, 2, 1),  # blocks longer than the context
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("workspace", [attention.WORKSPACE_BYTES, 1500])  # one chunk, then many
@pytest.mark.parametrize("window", [None, 8, 13])  # full attention, then sliding windows of 8 and 13 tokens
def test_sparse_equals_dense_reference_values_and_gradients(case, workspace, window, monkeypatch):
    monkeypatch.setattr(attention, "WORKSPACE_BYTES", workspace)
    seed, batch, slots, seq, bs, heads, kv_heads = case
    anchors, q, k, v, grad = random_case(seed, batch, slots, seq, bs, heads, kv_heads)
    layout = block_layout(anchors, seq, bs, heads, torch.device("cpu"), window)
    if workspace < 10_000:
        assert len(layout.chunks) > 1
    reference = dense_attention(q, k, v, dense_block_mask(anchors, seq, bs, window))
    sparse = block_sparse_attention(q, k, v, layout)
    torch.testing.assert_close(sparse, reference, rtol=0, atol=1e-12)
    for got, want in zip(
        torch.autograd.grad(sparse, (q, k, v), grad),
        torch.autograd.grad(reference, (q, k, v), grad),
        strict=True,
    ):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_padding_blocks_return_zeros_and_take_no_gradient():
    anchors, q, k, v, grad = random_case(5, 2, 4, 20, 4, 2, 1)
    anchors[1, 1:] = -1
    out = block_sparse_attention(q, k, v, block_layout(anchors, 20, 4, 2, torch.device("cpu")))
    assert out[1, :, 4:].abs().max() == 0
    (dq,) = torch.autograd.grad(out, (q,), grad)
    assert dq[1, :, 4:].abs().max() == 0


def test_sparse_gradcheck():
    anchors, q, k, v, _ = random_case(7, 2, 3, 9, 2, 2, 1, dim=3)
    layout = block_layout(anchors, 9, 2, 2, torch.device("cpu"))
    assert torch.autograd.gradcheck(lambda q, k, v: block_sparse_attention(q, k, v, layout), (q, k, v))


def test_chunk_plan_reads_keys_only_up_to_its_largest_anchor(monkeypatch):
    # 16 query rows per anchor, fp32: a chunk holds anchors x keys <= 400
    monkeypatch.setattr(attention, "WORKSPACE_BYTES", 16 * 400 * 4)
    anchors = torch.tensor([[10, 50, 90, 200, 300, 400]])
    layout = block_layout(anchors, 512, 16, 1, torch.device("cpu"))
    assert [c[:2] for c in layout.chunks] == [(0, 3), (3, 4), (4, 5), (5, 6)]
    assert [c[2:] for c in layout.chunks] == [(0, 90), (0, 200), (0, 300), (0, 400)]
    # with a 64-token window a chunk reads from its lowest anchor's window on: fewer keys, more anchors each
    layout = block_layout(anchors, 512, 16, 1, torch.device("cpu"), window=64)
    assert [c[:2] for c in layout.chunks] == [(0, 3), (3, 5), (5, 6)]
    assert [c[2:] for c in layout.chunks] == [(0, 90), (137, 300), (337, 400)]


def test_a_sliding_window_block_never_sees_context_older_than_its_window():
    """Mask and gradient: the query at block position k of a block anchored at a reads context keys
    a + k - W < j < a, never an older one, while a full-attention layer reads all of j < a."""
    anchors, q, k, v, _ = random_case(9, 1, 3, 40, 4, 2, 1)
    anchors = torch.tensor([[5, 20, 33]])
    window = 8
    mask = dense_block_mask(anchors, 40, 4, window)[0, 0]
    for slot, a in enumerate(anchors[0].tolist()):
        for offset in range(4):
            visible = mask[slot * 4 + offset, :40].nonzero().flatten().tolist()
            assert visible == list(range(max(0, a + offset - window + 1), a)), (a, offset)
    out = block_sparse_attention(q, k, v, block_layout(anchors, 40, 4, 2, torch.device("cpu"), window))
    (dk,) = torch.autograd.grad(out[:, :, 4 + 3].sum(), (k,))  # block 1 (anchor 20), position 3
    touched = dk[0, 0, :40].abs().sum(-1).nonzero().flatten().tolist()
    assert touched == list(range(23 - window + 1, 20))  # keys 16..19: the window, nothing older


def test_flex_tiles_at_the_recipe_shape():
    """flex's default 128 x 128 tiles compute at most 1.4x the allowed entries at 512 anchors x 16 (S=1024):
    the block-diagonal part wastes most of its tiles, but it is small next to the context part."""
    anchors = torch.randperm(1023, generator=torch.Generator().manual_seed(0))[:512].sort().values[None]
    mask = flex_block_mask(anchors, 1024, 16)
    q_tile, kv_tile = mask.BLOCK_SIZE
    tiles = mask.kv_num_blocks.sum() + mask.full_kv_num_blocks.sum()
    allowed = dense_block_mask(anchors, 1024, 16).sum()
    assert (q_tile, kv_tile) == (128, 128)
    assert 1.0 <= float(tiles * q_tile * kv_tile / allowed) <= 1.4


def drafter():
    torch.manual_seed(0)
    return DFlashDraftModel(small_draft_config(num_hidden_layers=1))


def test_dense_path_hands_sdpa_as_many_key_heads_as_query_heads_when_masked(monkeypatch):
    """SDPA's memory-efficient CUDA kernel refuses a mask together with GQA; the math fallback materialises
    the scores. So a masked call must come with K/V expanded to the query heads."""
    seen = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kwargs):
        seen.append((q.shape[1], k.shape[1], attn_mask is not None, kwargs.get("enable_gqa", False)))
        return real(q, k, v, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
    model = drafter()
    inputs = build_block_inputs(
        torch.randint(0, 48, (1, 12)), torch.ones(1, 12), [torch.tensor([3, 7])], 4, 49
    )
    with torch.no_grad():
        model(
            torch.randn(1, 8, 32),
            torch.randn(1, 12, 64),
            inputs.position_ids,
            dense_block_mask(inputs.anchors, 12, 4),
        )
    assert seen and all(q == k for q, k, masked, _ in seen if masked)


def test_bf16_autocast_gives_attention_one_dtype(monkeypatch):
    """Under autocast q/k pass RMSNorms with fp32 weights; flex in older torch refuses mixed q/k/v dtypes."""
    seen = []
    real = attention.block_sparse_attention

    def spy(q, k, v, layout):
        seen.append({q.dtype, k.dtype, v.dtype})
        return real(q, k, v, layout)

    monkeypatch.setattr(attention, "block_sparse_attention", spy)
    model = drafter()
    inputs = build_block_inputs(
        torch.randint(0, 48, (1, 12)), torch.ones(1, 12), [torch.tensor([3, 7])], 4, 49
    )
    layout = block_layout(inputs.anchors, 12, 4, 4, torch.device("cpu"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(
            torch.randn(1, 8, 32), torch.randn(1, 12, 64), inputs.position_ids, layout
        ).last_hidden_state
    out.float().sum().backward()
    assert seen == [{torch.bfloat16}]


def test_bf16_features_are_not_copied_to_fp32_under_autocast(monkeypatch):
    """Received bf16 features reach fc as they are (an fp32 copy of a 32768-token batch of 5 x 4096-wide
    features is 2.7 GB on the GPU)."""
    model = drafter()
    seen = []
    real = model.fc.forward
    monkeypatch.setattr(model.fc, "forward", lambda x: seen.append(x.dtype) or real(x))
    inputs = build_block_inputs(
        torch.randint(0, 48, (1, 12)), torch.ones(1, 12), [torch.tensor([3, 7])], 4, 49
    )
    layout = block_layout(inputs.anchors, 12, 4, 4, torch.device("cpu"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(
            torch.randn(1, 8, 32), torch.randn(1, 12, 64, dtype=torch.bfloat16), inputs.position_ids, layout
        )
    assert seen == [torch.bfloat16]
